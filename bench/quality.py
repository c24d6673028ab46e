"""Drafter quality per second of training: P-EAGLE against EAGLE-3 at equal wall-clock budgets.

Both methods train on ONE dataset (the config's data stage, built once and reused) with the
pipeline's own stage (``peagle.stages.train_head``: the launcher, DeepSpeed, one rank), and
each run's last checkpoint is measured with the pipeline's offline acceptance
(``peagle.stages.evaluate_offline``) on the held-out split. A budget of B seconds becomes
``train.max_steps = B / (seconds per step)``, the seconds per step measured by a short
calibration run of the same method and recipe, so the LR schedule fits the budget as it
would in a real run of that length. "train s" is the sum of the run's own step times
(``metrics.jsonl``: no launch, no evaluation), which is what the plot's x axis shows.

Two parts, both written to ``bench/results/quality.{md,json,png}``:

- ``ablation``: P-EAGLE recipes at one budget, each adding one choice to the one before
  (from the old default to the recipe), so each row's delta is what that choice bought.
- ``budgets``: the config's P-EAGLE recipe and its EAGLE-3 baseline at several budgets.

Results of earlier invocations are kept (a run is keyed by part, recipe, method, budget,
seed), so the parts can be run one after the other.

    .venv/bin/python bench/quality.py [--part ablation|budgets|all] [--budgets 45 90 180] [--seeds 0]
    .venv/bin/python bench/quality.py --quick          # tiny random target and dataset, ~2 min
    .venv/bin/python bench/quality.py --config configs/smollm2-135m-instruct.yaml --part budgets
                                                       # -> results/quality_smollm2-135m-instruct.*
    .venv/bin/python bench/quality.py --render-only    # re-print results/quality.json
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result_files import per_target_name, result_path  # noqa: E402
from train_common import (  # noqa: E402
    OFFLINE_NOTE, Run, head_parser, offline_acceptance, setup_head_bench, target_info, tiny_head_dataset,
    train_fresh,
)

NAME = "quality"
# The P-EAGLE recipe fields (peagle.methods.peagle's own train fields) of the old default.
OLD_RECIPE = {"train.freeze_lm_head": False, "train.train_embeddings": "all", "train.mask_hidden_init_std": 0.02,
              "train.k_train": 6, "train.depth0_loss_share": None, "train.grad_accum": 4, "train.learning_rate": 1e-3}
# Each ablation row adds one choice to the row before it.
ABLATION = [
    ("old default (all trainable, mask_hidden std 0.02)", {}),
    ("+ lm_head frozen", {"train.freeze_lm_head": True}),
    ("+ embeddings: mask row only", {"train.train_embeddings": "mask_row"}),
    ("+ mask_hidden std 1", {"train.mask_hidden_init_std": 1.0}),
    ("+ k_train 8", {"train.k_train": 8}),
    ("+ depth 0 half the loss", {"train.depth0_loss_share": 0.5}),
    ("+ grad_accum 1 (4x the optimizer steps)", {"train.grad_accum": 1}),
    ("+ lr 3e-3", {"train.learning_rate": 3e-3}),
]
RECIPE_LABEL = "config recipe"
CALIBRATION_STEPS = 6
QUICK_OVERRIDES = {"drafter.num_layers": 1, "train.k_train": 3, "train.eagle3_ttt_steps": 3, "train.max_len": 64,
                   "train.learning_rate": 3e-3, "train.warmup_ratio": 0.1, "train.grad_accum": 1}


# ----------------------------------------------------------------------------- measuring


def step_seconds(history: list[dict]) -> list[float]:
    return [r["step_time_s"] for r in history if "step_time_s" in r]


def calibrate(cfg_for, target, data_dir: Path) -> float:
    """Median seconds per optimizer step of a short run (its first step, which warms up, left out)."""
    from peagle.config import load_config  # noqa: F401 (cfg_for builds configs)

    trained, _ = train_fresh(cfg_for({"train.max_steps": CALIBRATION_STEPS, "train.epochs": 1}), target, data_dir)
    return statistics.median(step_seconds(trained.metrics_history)[1:])


def measure(cfg, target, data_dir: Path) -> dict:
    trained, wall = train_fresh(cfg, target, data_dir)
    seconds = step_seconds(trained.metrics_history)
    last = [r for r in trained.metrics_history if "loss" in r][-1]
    t = cfg.train
    return {"steps": len(seconds), "train_seconds": sum(seconds), "wall_seconds": wall, "final_loss": last["loss"],
            "train": {"lr": t.learning_rate, "grad_accum": t.grad_accum, "k_train": t.k_train,
                      "eagle3_ttt_steps": t.eagle3_ttt_steps},
            "final_train_acc": {k[len("acc/depth_"):]: v for k, v in last.items() if k.startswith("acc/depth_")},
            **offline_acceptance(cfg, target, data_dir, trained.last_checkpoint)}


class Bench:
    """Runs keyed by (part, recipe, method, budget, seed); step-time calibration per recipe."""

    def __init__(self, config: str, base: dict, target, data_dir: Path, work: Path, ks: list[int]):
        self.config, self.base, self.target, self.data_dir, self.work, self.ks = config, base, target, data_dir, work, ks
        self.step_s: dict[str, float] = {}

    def cfg(self, method: str, recipe: dict, extra: dict, tag: str):
        from peagle.config import load_config

        overrides = {**self.base, **recipe, "train.method": method, "train.eagle3_baseline": False,
                     "eval.ks": self.ks, **extra, "workdir": str(self.work / tag)}
        return load_config(self.config, overrides)

    def run(self, part: str, label: str, method: str, recipe: dict, budget: float, seed: int) -> dict:
        key = self.cfg(method, recipe, {}, "key").train.model_dump_json()  # the recipe as trained
        if key not in self.step_s:
            self.step_s[key] = calibrate(lambda extra: self.cfg(method, recipe, extra, "calibration"),
                                         self.target, self.data_dir)
        steps = max(2, math.ceil(budget / self.step_s[key]))
        cfg = self.cfg(method, recipe, {"train.max_steps": steps, "train.seed": seed}, f"{part}-{method}-{seed}")
        row = {"part": part, "recipe": label, "overrides": recipe, "method": method, "budget_s": budget, "seed": seed,
               "calibrated_step_s": self.step_s[key], **measure(cfg, self.target, self.data_dir)}
        print(f"[quality] {part} {label} {method} budget {budget}s seed {seed}: {row['steps']} steps, "
              f"{row['train_seconds']:.0f} s, AL {row['acceptance_length']}", flush=True)
        return row


def run_key(r: dict) -> tuple:
    return (r["part"], r["recipe"], r["method"], r["budget_s"], r["seed"])


def merged(old: list[dict], new: list[dict]) -> list[dict]:
    """Earlier runs plus the new ones; a new run replaces an old one with the same key."""
    fresh = {run_key(r) for r in new}
    return [r for r in old if run_key(r) not in fresh] + new


# ----------------------------------------------------------------------------- tables and plot


def mean_by(runs: list[dict], keys: tuple[str, ...]) -> dict[tuple, dict]:
    """Per group: mean acceptance per K, mean train seconds, number of seeds."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    return {g: {"al": {k: statistics.fmean(r["acceptance_length"][k] for r in rs) for k in rs[0]["acceptance_length"]},
                "pos": [statistics.fmean(p) for p in zip(*(r["per_position"] for r in rs))],
                "train_s": statistics.fmean(r["train_seconds"] for r in rs),
                "steps": statistics.fmean(r["steps"] for r in rs), "seeds": len(rs)}
            for g, rs in groups.items()}


def add_tables(run: Run, meta: dict) -> None:
    ks = [str(k) for k in meta["ks"]]
    budgets = mean_by([r for r in meta["runs"] if r["part"] == "budgets"], ("method", "budget_s"))
    if budgets:
        rows = [[m, f"{b:g}", f"{v['train_s']:.0f}", f"{v['steps']:.0f}", v["seeds"], *[f"{v['al'][k]:.3f}" for k in ks],
                 " ".join(f"{p:.2f}" for p in v["pos"])]
                for (m, b), v in sorted(budgets.items(), key=lambda kv: (kv[0][1], kv[0][0]))]
        run.add_table("Offline acceptance length per K at equal training time (the config's recipes)",
                      ["method", "budget s", "train s", "steps", "seeds", *[f"K={k}" for k in ks], "per position"],
                      rows, note="mean over seeds; train s = the run's summed step times (no launch, no evaluation)")
    ablation = mean_by([r for r in meta["runs"] if r["part"] == "ablation"], ("recipe", "method", "budget_s"))
    if ablation:
        order = [label for label, _ in ABLATION] + [RECIPE_LABEL]
        rows, previous = [], None
        for (label, method, budget), v in sorted(ablation.items(), key=lambda kv: (
                kv[0][1] != "peagle", order.index(kv[0][0]) if kv[0][0] in order else len(order))):
            k5 = ks[min(len(ks), 5) - 1]
            delta = "" if previous is None or method != "peagle" else f"{v['al'][k5] - previous:+.3f}"
            rows.append([label, method, f"{budget:g}", f"{v['train_s']:.0f}", f"{v['steps']:.0f}",
                         *[f"{v['al'][k]:.3f}" for k in ks], delta, " ".join(f"{p:.2f}" for p in v["pos"])])
            if method == "peagle":
                previous = v["al"][k5]
        run.add_table("Ablation: P-EAGLE recipe choices at one budget (each row adds one choice to the row above)",
                      ["recipe", "method", "budget s", "train s", "steps", *[f"K={k}" for k in ks],
                       f"delta K={ks[min(len(ks), 5) - 1]}", "per position"], rows,
                      note="the eagle3 row is the baseline at the same budget")


def plot(meta: dict, out: Path) -> None:
    """Acceptance length at K=5 (or the largest K) against training seconds, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from peagle.fileio import atomic_path

    k = str(min(max(meta["ks"]), 5))
    runs = [r for r in meta["runs"] if r["part"] == "budgets"]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for method, style in (("peagle", "o-"), ("eagle3", "s--")):
        # joined in budget order (the machine's load can make a longer run's seconds shorter)
        mine = sorted((r for r in runs if r["method"] == method), key=lambda r: (r["budget_s"], r["steps"]))
        if mine:
            xs, ys = [r["train_seconds"] for r in mine], [r["acceptance_length"][k] for r in mine]
            ax.plot(xs, ys, style, label=f"{'P-EAGLE' if method == 'peagle' else 'EAGLE-3'} (one run per point)")
            for x, y, r in zip(xs, ys, mine):
                ax.annotate(f"{r['steps']} steps", (x, y), textcoords="offset points", xytext=(4, -12), fontsize=8)
    ax.set_xlabel("training seconds (summed step times)")
    ax.set_ylabel(f"offline acceptance length, K={k}")
    ax.set_title(f"Acceptance vs training time, {meta['data_name']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def notes(meta: dict) -> list[str]:
    runs = meta["runs"]
    return [
        f"data: {meta['data_dir']}" + (" (tiny random target, --quick)" if meta["args"].get("quick") else ""),
        f"budget -> train.max_steps via a {CALIBRATION_STEPS}-step calibration run per method and recipe; "
        f"config {meta['args']['config']} with {json.dumps(meta['base_overrides'])}; "
        f"OMP_NUM_THREADS={meta['args']['threads']}; {len(runs)} runs",
        OFFLINE_NOTE,
        "shared 2-core machine: step times vary with the other jobs' load (see load averages)",
    ]


# ----------------------------------------------------------------------------- main


def render(run: Run) -> None:
    add_tables(run, run.meta)
    if any(r["part"] == "budgets" for r in run.meta["runs"]):
        plot(run.meta, result_path(run.name, ".png"))
    run.finish(notes(run.meta))


def result_name(config: str, quick: bool) -> str:
    """``quality`` for the demo's target (and --quick), ``quality_<config>`` for another."""
    return NAME if quick else per_target_name(NAME, config)


def main() -> None:
    parser = head_parser(__doc__)
    parser.add_argument("--part", choices=["ablation", "budgets", "all"], default="all")
    parser.add_argument("--budgets", type=float, nargs="+", default=[45, 90, 180], help="training seconds per run")
    parser.add_argument("--ablation-budget", type=float, default=90)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--ablation-rows", type=int, nargs="+", default=None,
                        help="run only these ablation rows (0-based; each still adds the rows above it) and "
                             "skip the EAGLE-3 row; earlier rows' results are kept")
    parser.add_argument("--quick", action="store_true", help="a tiny random target and dataset, tiny budgets")
    parser.add_argument("--render-only", action="store_true", help=f"re-print results/{NAME}.json")
    args = parser.parse_args()
    name = result_name(args.config, args.quick)
    if args.render_only:
        render(Run.restore(name))
        return

    from peagle.config import load_config
    from peagle.layout import RunLayout
    from peagle.paths import peagle_home

    setup_head_bench(args.threads)
    run = Run(name, vars(args))
    base = {"train.epochs": args.epochs} if args.epochs else {}
    with tempfile.TemporaryDirectory(prefix="peagle-bench-") as tmp:
        if args.quick:
            data_dir, target_dir = tiny_head_dataset(Path(tmp))
            base, work = {**QUICK_OVERRIDES, **base}, Path(tmp) / "runs"
            budgets, ablation_budget, seeds = [3.0], 3.0, args.seeds[:1]
            rows = [0, len(ABLATION) - 1]  # the old default and the whole recipe
        else:
            from peagle.target import resolve_target

            cfg0 = load_config(args.config)
            data_dir = Path(args.data_dir) if args.data_dir else RunLayout(cfg0.run_dir).data.root
            target_dir, work = resolve_target(cfg0.target), peagle_home() / "bench" / name
            budgets, ablation_budget, seeds = args.budgets, args.ablation_budget, args.seeds
            rows = args.ablation_rows
        train = load_config(args.config, base).train
        ks = list(range(1, min(train.k_train, train.eagle3_ttt_steps) + 1))
        bench = Bench(args.config, base, target_info(target_dir, data_dir), data_dir, work, ks)
        runs = []
        for seed in seeds:
            if args.part in ("ablation", "all"):
                recipe = dict(OLD_RECIPE)
                for i, (label, change) in enumerate(ABLATION):
                    recipe.update(change)
                    if rows is None or i in rows:
                        runs.append(bench.run("ablation", label, "peagle", dict(recipe), ablation_budget, seed))
                if args.ablation_rows is None:
                    runs.append(bench.run("ablation", "EAGLE-3 (config)", "eagle3", {}, ablation_budget, seed))
            if args.part in ("budgets", "all"):
                for budget in budgets:  # the pair back to back: both see about the same machine load
                    for method in ("peagle", "eagle3"):
                        runs.append(bench.run("budgets", RECIPE_LABEL, method, {}, budget, seed))
    old = [] if args.quick or not result_path(name, ".json").exists() else Run.restore(name).meta.get("runs", [])
    run.meta.update({"data_dir": str(data_dir), "data_name": "tiny random target" if args.quick else Path(args.config).stem,
                     "ks": ks, "base_overrides": base, "runs": merged(old, runs)})
    render(run)


if __name__ == "__main__":
    main()
