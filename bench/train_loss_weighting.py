"""Per-depth loss weighting: "uniform" vs "per_depth_mean" (``train.recipe.loss_depth_weighting``).

"uniform" divides the KL sum by the number of supervised elements, so deep depths (fewer
elements after COD subsampling) weigh less; "per_depth_mean" averages each depth's mean
KL over the depths. The same drafter config is trained on the same dataset with each
(same seed, the config's train settings, ``peagle.stages.train_head``), and each head's
last checkpoint is measured with ``peagle.stages.evaluate_offline`` on the held-out
split: acceptance length per K and per-position acceptance. Also reported: each run's
per-depth top-1 agreement with the target on its training batches over the last epoch.
``--seeds`` repeats the pair per seed; the seed-to-seed spread is the noise estimate.

    .venv/bin/python bench/train_loss_weighting.py [--config configs/demo.yaml] [--seeds 0 1] [--epochs N]
    .venv/bin/python bench/train_loss_weighting.py --quick   # tiny random target and dataset, ~1 min
    .venv/bin/python bench/train_loss_weighting.py --render-only   # re-print results/train_loss_weighting.json
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_common import (  # noqa: E402
    OFFLINE_NOTE,
    Run,
    epochs_override,
    head_parser,
    offline_acceptance,
    setup_head_bench,
    target_info,
    tiny_head_dataset,
    train_fresh,
    train_note,
    train_settings,
)

NAME = "train_loss_weighting"
WEIGHTINGS = ("uniform", "per_depth_mean")
# --quick: a budget that trains something in seconds on the tiny dataset.
QUICK_OVERRIDES = {"drafter.num_layers": 1, "train.peagle.k_train": 3, "train.recipe.max_len": 64, **epochs_override(2),
                   "train.recipe.learning_rate": 3e-3, "train.recipe.warmup_ratio": 0.1, "eval.ks": [1, 3]}


def last_epoch_depth_acc(history: list[dict], k: int) -> dict:
    """Per-depth top-1 agreement (and overall) averaged over the last epoch's step records."""
    steps = [r for r in history if "acc" in r]
    last = [r for r in steps if r["epoch"] == steps[-1]["epoch"]]
    out = {}
    for d in range(k):
        values = [r[f"acc/depth_{d}"] for r in last if f"acc/depth_{d}" in r]
        out[str(d)] = statistics.fmean(values) if values else None
    out["all"] = statistics.fmean(r["acc"] for r in last)
    return out


def measure(cfg, target, data_dir: Path) -> dict:
    trained, seconds = train_fresh(cfg, target, data_dir)
    steps = [r for r in trained.metrics_history if "loss" in r]
    return {
        "weighting": cfg.train.recipe.loss_depth_weighting,
        "seed": cfg.train.recipe.seed,
        "train_seconds": seconds,
        "steps": len(steps),
        "final_loss": steps[-1]["loss"],
        "train_acc_last_epoch": last_epoch_depth_acc(trained.metrics_history, cfg.train.peagle.k_train),
        **offline_acceptance(cfg, target, data_dir, trained.last_checkpoint),
    }


def summarize(runs: list[dict], ks: list[int]) -> dict:
    """Per weighting: mean acceptance length per K over seeds and its spread (max - min); the
    per-seed paired difference per_depth_mean - uniform and its mean."""
    out = {}
    for w in WEIGHTINGS:
        per_k = {str(k): [r["acceptance_length"][str(k)] for r in runs if r["weighting"] == w] for k in ks}
        out[w] = {"mean": {k: statistics.fmean(v) for k, v in per_k.items()},
                  "spread": {k: max(v) - min(v) for k, v in per_k.items()}}
    by = {(r["weighting"], r["seed"]): r["acceptance_length"] for r in runs}
    seeds = sorted({r["seed"] for r in runs})
    paired = {s: {str(k): by["per_depth_mean", s][str(k)] - by["uniform", s][str(k)] for k in ks} for s in seeds}
    out["per_depth_mean_minus_uniform"] = {
        "per_seed": {str(s): d for s, d in paired.items()},
        "mean": {str(k): statistics.fmean(paired[s][str(k)] for s in seeds) for k in ks},
    }
    return out


def per_k(values: dict, ks: list[int], spec: str = ".3f") -> list[str]:
    return [format(values[str(k)], spec) for k in ks]


def add_tables(run: Run, meta: dict) -> None:
    runs, summary, ks, k_train = meta["runs"], meta["summary"], meta["ks"], meta["train"]["k_train"]
    multi = len(runs) > len(WEIGHTINGS)
    rows = [[r["weighting"], r["seed"], *per_k(r["acceptance_length"], ks), f"{r['train_seconds']:.0f}"] for r in runs]
    if multi:
        rows += [[w, "mean", *per_k(summary[w]["mean"], ks), ""] for w in WEIGHTINGS]
        rows += [[w, "max - min", *per_k(summary[w]["spread"], ks), ""] for w in WEIGHTINGS]
    delta = summary["per_depth_mean_minus_uniform"]
    rows += [["per_depth_mean - uniform", s, *per_k(d, ks, "+.3f"), ""] for s, d in delta["per_seed"].items()]
    if multi:
        rows.append(["per_depth_mean - uniform", "mean", *per_k(delta["mean"], ks, "+.3f"), ""])
    run.add_table("Offline acceptance length per K, held-out split (last checkpoint)",
                  ["weighting", "seed", *[f"K={k}" for k in ks], "train s"], rows,
                  note=f"{runs[0]['num_anchors']} eval anchors; reference = the stored target tokens; "
                       "'per_depth_mean - uniform' rows pair the two runs of one seed")
    run.add_table("Per-position acceptance P(draft k accepted), held-out split",
                  ["weighting", "seed", *[f"k={k}" for k in range(1, len(runs[0]['per_position']) + 1)]],
                  [[r["weighting"], r["seed"], *[f"{p:.3f}" for p in r["per_position"]]] for r in runs])
    acc = [[r["weighting"], r["seed"],
            *[f"{v:.3f}" if (v := r["train_acc_last_epoch"][str(d)]) is not None else "-" for d in range(k_train)],
            f"{r['train_acc_last_epoch']['all']:.3f}", f"{r['final_loss']:.3f}"] for r in runs]
    run.add_table("Training top-1 agreement with the target per depth, mean over the last epoch's steps",
                  ["weighting", "seed", *[f"d={d}" for d in range(k_train)], "all", "last loss"], acc,
                  note="training batches (COD-subsampled depths >= 1); 'last loss' is the optimised loss of the "
                       "last step, in each weighting's own units")


def notes(meta: dict) -> list[str]:
    t, runs = meta["train"], meta["runs"]
    return [
        f"data: {meta['data_dir']}" + (" (tiny random target, --quick)" if meta["args"]["quick"] else ""),
        f"{train_note(t)}, {runs[0]['steps']} steps, COD {t['cod_ratio']} (floor {t['cod_floor']}); "
        f"seeds {sorted({r['seed'] for r in runs})}; wall s per run incl. launch: "
        f"{min(r['train_seconds'] for r in runs):.0f}-{max(r['train_seconds'] for r in runs):.0f}",
        OFFLINE_NOTE,
    ]


def main() -> None:
    parser = head_parser(__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="train.recipe.seed values (one pair per seed)")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny random target and dataset built in a temporary directory, one seed")
    parser.add_argument("--render-only", action="store_true", help=f"re-print results/{NAME}.json")
    args = parser.parse_args()
    if args.render_only:
        run = Run.restore(NAME)
        add_tables(run, run.meta)
        run.finish(notes(run.meta))
        return

    from peagle.config import load_config
    from peagle.layout import RunLayout
    from peagle.paths import peagle_home

    setup_head_bench(args.threads)
    run = Run(NAME, vars(args))  # after setup: records the thread count the evaluation runs with
    overrides = epochs_override(args.epochs)
    with tempfile.TemporaryDirectory(prefix="peagle-bench-") as tmp:
        if args.quick:
            data_dir, target_dir = tiny_head_dataset(Path(tmp))
            overrides, seeds, work = {**QUICK_OVERRIDES, **overrides}, args.seeds[:1], Path(tmp) / "runs"
        else:
            from targets import bench_target

            base = load_config(args.config)
            data_dir = Path(args.data_dir) if args.data_dir else RunLayout(base.run_dir).data.root
            target_dir, seeds, work = bench_target(base.target), args.seeds, peagle_home() / "bench" / NAME
        train = load_config(args.config, overrides).train
        ks = list(range(1, train.peagle.k_train + 1))
        target = target_info(target_dir, data_dir)
        runs = []
        for seed in seeds:  # the pair back to back, so both see about the same machine load
            for weighting in WEIGHTINGS:
                cfg = load_config(args.config, {**overrides, "eval.ks": ks, "train.recipe.seed": seed,
                                                "train.recipe.loss_depth_weighting": weighting,
                                                "train.peagle.depth0_loss_share": None,  # plain "uniform", not the recipe's share
                                                "workdir": str(work / f"{weighting}-seed{seed}")})
                runs.append(measure(cfg, target, data_dir))
    run.meta.update({"data_dir": str(data_dir), "ks": ks, "runs": runs, "summary": summarize(runs, ks),
                     "train": {**train_settings(train, args.threads), "cod_ratio": train.peagle.cod_ratio,
                               "cod_floor": train.peagle.cod_floor}})
    add_tables(run, run.meta)
    run.finish(notes(run.meta))


if __name__ == "__main__":
    main()
