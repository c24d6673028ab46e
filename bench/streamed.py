"""Stored vs streamed hidden states (``data.hidden_states``) on a config's data: disk and training speed.

Builds the config's dataset both ways (``peagle data``, two work directories; the streamed
build reuses the stored build's regenerated responses, which the regeneration key allows),
then, for each seed, trains the config's head for ``--steps`` optimizer steps three ways
(``peagle train``, the order turning per seed): on the stored dataset; streamed through a
spool of ``--spool-gib`` (each chunk deleted once read, every epoch extracted again); and
streamed through a spool of ``--kept-spool-gib`` that holds the whole train split (each
sample extracted once and kept for the later epochs), sampling the disk the run holds
(dataset and spool) and the spool's chunks every 0.1 s. Reported per kind: the data stage's
wall time when it was built in this run, the dataset's bytes, the peak of dataset + spool
while training, the epochs the spool's chunks were extracted for, ``peagle train``'s wall
time (engine and rank start-up included) and the optimizer steps' tokens/s (``metrics.jsonl``:
tokens over step time, each run's first step left out); then each over stored. On one machine
the producer (a vLLM engine) and the ranks share the cores; on a GPU node they get GPUs of
their own (``vllm.devices``, ``train.launch.devices``). ``--set KEY=VALUE`` reaches every command,
e.g. ``train.recipe.max_samples`` to train several epochs of a few samples.

    .venv/bin/python bench/streamed.py [--config configs/demo.yaml] [--steps 60] [--seeds 0 1] [--set K=V ...]
    .venv/bin/python bench/streamed.py --render-only

Results go to ``results/streamed.*`` for the demo's config, ``results/streamed_<config>.*`` for another.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from peagle.fileio import tree_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_common import render_saved, report, started  # noqa: E402
from result_files import per_target_name  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
NAME = "streamed"
KINDS = ("stored", "streamed", "kept")
BUILT = ("stored", "streamed")  # the datasets; kept trains on the streamed one


def dataset_of(kind: str) -> str:
    return "streamed" if kind == "kept" else kind


def peagle(*args: str) -> float:
    """Run ``peagle ARGS`` (its output to the console); its wall seconds. A failure stops the bench."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "peagle.cli", *map(str, args)], cwd=REPO, check=True)
    return round(time.perf_counter() - start, 1)


def kind_config(config: Path, kind: str, workdir: Path, spool_gib: float) -> Path:
    """The config with its dataset's ``data.hidden_states``, the kind's spool cap and the
    dataset's work directory."""
    cfg = yaml.safe_load(config.read_text())
    cfg["workdir"] = str(workdir / dataset_of(kind))
    cfg.setdefault("data", {})["hidden_states"] = dataset_of(kind)
    cfg["data"]["spool_gib"] = spool_gib
    path = workdir / f"{kind}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def build(configs: dict[str, Path], workdir: Path, sets: list[str]) -> dict[str, float | None]:
    """``peagle data`` for each dataset not built yet; wall seconds of each build made here."""
    seconds = {}
    for kind in BUILT:
        data = workdir / kind / "data"
        if (data / "build.json").exists():
            seconds[kind] = None
            continue
        if kind == "streamed" and (workdir / "stored" / "data" / "samples.jsonl").exists():
            data.mkdir(parents=True, exist_ok=True)  # the same regeneration key: its responses are reused
            shutil.copy2(workdir / "stored" / "data" / "samples.jsonl", data / "samples.jsonl")
        seconds[kind] = peagle("data", configs[kind], *sets)
    return seconds


def train(config: Path, workdir: Path, kind: str, steps: int, seed: int, sets: list[str]) -> dict:
    """One ``peagle train`` of ``steps`` steps from scratch; its wall time, tokens/s, peak disk and
    the epochs its spool's chunks were extracted for."""
    run = workdir / dataset_of(kind)
    shutil.rmtree(run / "checkpoints", ignore_errors=True)
    dataset = tree_bytes(run / "data")
    peak, epochs, done = [0], set(), threading.Event()

    def sample() -> None:
        while not done.is_set():
            spools = list((run / "checkpoints").glob("*/*/spool"))
            peak[0] = max(peak[0], sum(tree_bytes(s) for s in spools))
            epochs.update(chunk.name.split("-")[0] for s in spools for chunk in s.glob("e*-c*") if "." not in chunk.name)
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        wall = peagle("train", config, *sets, "--set", f"train.recipe.max_steps={steps}", "--set",
                      "train.recipe.max_train_seconds=null", "--set", f"train.recipe.seed={seed}")
    finally:
        done.set()
        sampler.join()
    [metrics] = (run / "checkpoints").glob("*/*/metrics.jsonl")
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if "step_time_s" in r][1:]
    tokens_per_s = sum(r["tokens"] for r in records) / sum(r["step_time_s"] for r in records)
    return {"kind": kind, "seed": seed, "wall_s": wall, "tokens_per_s": round(tokens_per_s, 1),
            "dataset_bytes": dataset, "peak_spool_bytes": peak[0], "steps": steps,
            "epochs_extracted": len(epochs)}


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def tables(result: dict):
    runs = result["runs"]

    def mean(kind: str, key: str) -> float:
        values = [r[key] for r in runs if r["kind"] == kind]
        return sum(values) / len(values)

    kinds = [k for k in KINDS if any(r["kind"] == k for r in runs)]
    rows = []
    for kind in kinds:
        built = result["data_seconds"].get(kind)
        rows.append([kind, "-" if built is None else f"{built:.0f}", mib(mean(kind, "dataset_bytes")),
                     mib(mean(kind, "dataset_bytes") + mean(kind, "peak_spool_bytes")),
                     f"{mean(kind, 'epochs_extracted'):.0f}" if kind != "stored" else "-",
                     f"{mean(kind, 'wall_s'):.0f}", f"{mean(kind, 'tokens_per_s'):.0f}",
                     f"{mean(kind, 'tokens_per_s') / mean('stored', 'tokens_per_s'):.2f}"])
    per_seed = [[str(r["seed"]), r["kind"], f"{r['wall_s']:.0f}", f"{r['tokens_per_s']:.0f}", mib(r["peak_spool_bytes"])]
                for r in runs]
    sets = f" {' '.join(result['sets'])}" if result.get("sets") else ""
    return [
        (f"Stored vs streamed, {result['steps']} steps x {len(result['seeds'])} seeds: {result['config']}{sets}",
         ["hidden states", "data stage s", "dataset MiB", "peak dataset + spool MiB", "epochs extracted",
          "peagle train s", "tokens/s", "x stored"], rows),
        ("Per run", ["seed", "hidden states", "peagle train s", "tokens/s", "peak spool MiB"], per_seed),
    ]


def notes(result: dict) -> list[str]:
    kept = (f"; kept: the streamed dataset through a spool of {result['kept_spool_gib']} GiB, which holds the whole "
            "train split, so each sample is extracted once and later epochs read the kept chunks"
            if "kept_spool_gib" in result else "")
    return [
        f"spool cap (data.spool_gib) {result['spool_gib']} GiB{kept}; epochs extracted: the epochs whose chunks "
        "appeared in the spool; tokens/s: the optimizer steps' (metrics.jsonl), each "
        "run's first step left out; peagle train s: the whole command (the streamed run starts a vLLM engine first)",
        "data stage s: the build's wall time in this run (- when the dataset was already built); the streamed build "
        "reuses the stored build's regenerated responses, so it times extraction and the rest, not regeneration",
        "on this machine the producer and the ranks share the cores: the streamed tokens/s pays for extraction; on a "
        "GPU node with GPUs of their own the producer keeps up when the engines' prefill tokens/s is at least the "
        "ranks' training tokens/s",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "demo.yaml")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--spool-gib", type=float, default=0.05)
    parser.add_argument("--kept-spool-gib", type=float, default=4.0, help="a cap the whole train split fits under")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every command (peagle --set)")
    parser.add_argument("--workdir", type=Path, default=REPO / ".peagle" / "bench" / "streamed")
    parser.add_argument("--render-only", action="store_true")
    args = parser.parse_args()
    name = per_target_name(NAME, args.config)
    if args.render_only:
        render_saved(name, tables, notes)
        return
    result = {**started(), "config": str(args.config), "steps": args.steps, "seeds": args.seeds,
              "spool_gib": args.spool_gib, "kept_spool_gib": args.kept_spool_gib, "sets": args.sets}
    configs = {kind: kind_config(args.config, kind, args.workdir,
                                 args.kept_spool_gib if kind == "kept" else args.spool_gib) for kind in KINDS}
    sets = [arg for kv in args.sets for arg in ("--set", kv)]
    result["data_seconds"] = build(configs, args.workdir, sets)
    result["runs"] = []
    for n, seed in enumerate(args.seeds):
        for kind in KINDS[n % len(KINDS):] + KINDS[: n % len(KINDS)]:
            result["runs"].append(train(configs[kind], args.workdir, kind, args.steps, seed, sets))
    report(name, result, tables(result), notes(result))


if __name__ == "__main__":
    main()
