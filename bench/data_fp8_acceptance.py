"""Does float8 storage of the hidden states cost offline acceptance?

The demo dataset's shards (bfloat16) are re-stored as float8 (e4m3, one scale per
token and layer) with ``ShardWriter``: same samples, same token ids, same loss masks,
same draft vocabulary. The same drafter config is trained on each (same seed, the
config's train settings, ``peagle.stages.train_head``), and each head's offline
acceptance per K is measured with ``peagle.stages.evaluate_offline`` on both eval
splits: its own, and the bfloat16 one (what a served head sees is the target's
unquantised hidden states). Also reported: the float8 round-trip error of the stored
hidden states.

    .venv/bin/python bench/data_fp8_acceptance.py [--config configs/demo.yaml] [--epochs N]
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

from peagle.layout import SPLITS, TARGET_FACTS_FILE, VOCAB_FILE, DataLayout, RunLayout

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_common import render_saved, report, started  # noqa: E402
from train_common import (  # noqa: E402
    OFFLINE_NOTE,
    epochs_override,
    head_parser,
    offline_acceptance,
    setup_head_bench,
    target_info,
    train_fresh,
    train_note,
    train_settings,
)

NAME = "data_fp8_acceptance"


def fp8_copy(src_data: Path, dst_data: Path) -> dict:
    """The dataset at ``src_data`` with its hidden states re-stored as float8; returns errors."""
    from peagle.data.store import ShardReader, ShardWriter

    shutil.rmtree(dst_data, ignore_errors=True)
    dst_data.mkdir(parents=True)
    for name in (TARGET_FACTS_FILE, VOCAB_FILE):
        shutil.copy2(src_data / name, dst_data / name)
    err2, ref2 = None, None
    for split in SPLITS:
        reader = ShardReader(DataLayout(src_data).split(split), verify=True)
        m = reader.manifest
        meta = {"config_hash": m.get("config_hash"), "target": m.get("target"), "target_revision": m.get("target_revision")}
        with ShardWriter(DataLayout(dst_data).split(split), m["layer_ids"], m["hidden_size"], "float8",
                         262_144, meta) as writer:
            for s in reader:
                writer.add(s.id, s.token_ids, s.loss_mask, s.hidden)
        back = ShardReader(DataLayout(dst_data).split(split), verify=True)
        for a, b in zip(reader, back, strict=True):
            if not torch.equal(a.token_ids, b.token_ids) or not torch.equal(a.loss_mask, b.loss_mask):
                raise RuntimeError(f"sample {a.id}: tokens or mask changed in the float8 copy")
            e, r = ((b.hidden - a.hidden) ** 2).sum(dim=(0, 2)), (a.hidden**2).sum(dim=(0, 2))
            err2, ref2 = (e, r) if err2 is None else (err2 + e, ref2 + r)
    layer_ids = json.loads(DataLayout(dst_data).manifest("train").read_text())["layer_ids"]
    return {f"layer_{k}": float((err2[i] / ref2[i]).sqrt()) for i, k in enumerate(layer_ids)}


def split_bytes(data_dir: Path) -> int:
    return sum(json.loads(DataLayout(data_dir).manifest(s).read_text())["bytes"] for s in SPLITS)


def tables(result: dict) -> list:
    ks = result["ks"]
    rows = [[row["trained_on"], row["evaluated_on"], *[f"{row['acceptance_length'][str(k)]:.3f}" for k in ks]]
            for row in result["rows"]]
    d = result["delta_fp8_minus_bf16"]
    rows.append(["float8 - bfloat16", "own split", *[f"{d['own_split'][str(k)]:+.3f}" for k in ks]])
    rows.append(["float8 - bfloat16", "bfloat16", *[f"{d['bf16_split'][str(k)]:+.3f}" for k in ks]])
    t = result["train"]
    return [(f"Offline acceptance length per K: {t['epochs']} epoch(s), seed {t['seed']}, K_train {t['k_train']}; "
             f"{result['num_eval_anchors']} eval anchors", ["head trained on", "evaluated on", *[f"K={k}" for k in ks]],
             rows)]


def notes(result: dict) -> list[str]:
    b, t = result["bytes"], result["train"]
    err = ", ".join(f"{k} {v:.4f}" for k, v in result["fp8_relative_rms_error"].items())
    return [
        "float8 = e4m3 with a float32 scale per token and layer, re-stored from the bfloat16 shards "
        "(same samples, token ids, masks, draft vocabulary)",
        f"float8 relative RMS error of the stored hidden states vs bfloat16: {err}",
        f"dataset bytes (train + eval): bfloat16 {b['bfloat16']}, float8 {b['float8']} "
        f"(x{b['float8'] / b['bfloat16']:.3f})",
        f"{train_note(t)}, seed {t['seed']}; last checkpoint of each run; "
        f"wall s {', '.join(f'{k} {v:.0f}' for k, v in t['seconds'].items())}",
        OFFLINE_NOTE,
    ]


def main() -> None:
    parser = head_parser(__doc__)
    parser.add_argument("--render-only", action="store_true", help="re-print results/data_fp8_acceptance.json")
    args = parser.parse_args()
    if args.render_only:
        render_saved(NAME, tables, notes)
        return

    from targets import bench_target

    from peagle.config import load_config
    from peagle.paths import peagle_home

    setup_head_bench(args.threads)
    base = load_config(args.config)
    bf16_data = Path(args.data_dir) if args.data_dir else RunLayout(base.run_dir).data.root
    if json.loads(DataLayout(bf16_data).manifest("train").read_text())["storage_dtype"] != "bfloat16":
        raise ValueError(f"{bf16_data} is not a bfloat16 dataset; point --data-dir at one")
    work = peagle_home() / "bench" / "data_fp8_acceptance"
    ks = list(range(1, base.train.peagle.k_train + 1))
    overrides = {"eval.ks": ks, **epochs_override(args.epochs)}
    cfgs = {d: load_config(args.config, {**overrides, "workdir": str(work / d)}) for d in ("bfloat16", "float8")}
    target = target_info(bench_target(base.target), bf16_data)

    stamp = started()
    fp8_data = RunLayout(work / "float8").data.root
    fp8_error = fp8_copy(bf16_data, fp8_data)
    data = {"bfloat16": bf16_data, "float8": fp8_data}
    checkpoints, train_s = {}, {}
    for dtype, cfg in cfgs.items():
        trained, train_s[dtype] = train_fresh(cfg, target, data[dtype])
        checkpoints[dtype] = Path(trained.last_checkpoint)

    rows, num_anchors = [], None
    for trained in ("bfloat16", "float8"):
        for evaluated in ("bfloat16", "float8"):
            off = offline_acceptance(cfgs[trained], target, data[evaluated], checkpoints[trained])
            num_anchors = off["num_anchors"]
            rows.append({"trained_on": trained, "evaluated_on": evaluated, **off})
    acc = {(r["trained_on"], r["evaluated_on"]): r["acceptance_length"] for r in rows}
    result = {
        "benchmark": NAME,
        **stamp,
        "config": str(args.config),
        "bf16_data_dir": str(bf16_data),
        "ks": ks,
        "train": {**train_settings(cfgs["bfloat16"].train, args.threads), "seconds": train_s},
        "checkpoints": {k: str(v) for k, v in checkpoints.items()},
        "num_eval_anchors": num_anchors,
        "rows": rows,
        "delta_fp8_minus_bf16": {
            "own_split": {str(k): acc["float8", "float8"][str(k)] - acc["bfloat16", "bfloat16"][str(k)] for k in ks},
            "bf16_split": {str(k): acc["float8", "bfloat16"][str(k)] - acc["bfloat16", "bfloat16"][str(k)] for k in ks},
        },
        "fp8_relative_rms_error": fp8_error,
        "bytes": {"bfloat16": split_bytes(bf16_data), "float8": split_bytes(fp8_data)},
    }
    report(NAME, result, tables(result), notes(result))


if __name__ == "__main__":
    main()
