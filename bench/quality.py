"""Drafter quality per second of training: P-EAGLE against EAGLE-3 at equal wall-clock budgets.

Both methods train on ONE dataset (the config's data stage, built once and reused) with the
pipeline's own stage (``peagle.stages.train_head``: the launcher, DeepSpeed, one rank), and
each run's last checkpoint is measured with the pipeline's offline acceptance
(``peagle.stages.evaluate_offline``) on the held-out split. A budget of B seconds becomes
``train.recipe.max_steps = B / (seconds per step)``, the seconds per step measured by a short
calibration run of the same method and recipe, so the LR schedule fits the budget as it
would in a real run of that length. "train s" is the sum of the run's own step times
(``metrics.jsonl``: no launch, no evaluation), which is what the plot's x axis shows.

The parts, all written to ``bench/results/quality.{md,json,png}``:

- ``ablation``: P-EAGLE recipes at one budget, each adding one choice to the one before
  (from a plain starting recipe to the config's), so each row's delta is what that choice buys.
- ``variants``: the config's P-EAGLE recipe and recipes that each change one thing of it, at
  one budget (``--ablation-budget``), so each row's delta is what that one change buys.
- ``data``: the config's P-EAGLE recipe on the first N answers of the train split
  (``train.recipe.max_samples``, ``--sizes``) for the steps of one budget: how acceptance grows with data.
- ``copying``: trains nothing; evaluates the saved runs' checkpoints again for what every new run
  records: vLLM's n-gram lookup walked on the same tokens, and each head's hits split by whether
  n-gram lookup drafts the token right (does the head learn what copying from the context gives?).
- ``budgets``: the config's P-EAGLE recipe and its EAGLE-3 baseline at several budgets.
  With ``--online``, each method's head of the largest budget is then served in vLLM (the
  pipeline's ``evaluate_online``: K = 5, concurrency 1 and 4, against no speculation), so the
  offline numbers are confirmed by what a user would see and the tokens/s are measured.

Results of earlier invocations are kept (a run is keyed by part, recipe, method, budget,
seed), so the parts can be run one after the other; the files are rewritten after every
run, so a stopped invocation keeps the rows it finished (its header says "running").

Every run is also an MLflow run of experiment ``peagle-bench-<result name>`` in the config's
tracking store (``MLFLOW_TRACKING_URI``, else peagle's SQLite under ``.peagle/``): its step
metrics stream there while it trains, then its recipe (params), acceptance per K of the head
and of n-gram lookup and its training numbers (metrics) and the row itself (``run.json``), so
the MLflow UI compares runs across invocations (``mlflow ui --backend-store-uri URI``).

    .venv/bin/python bench/quality.py [--part ablation|variants|budgets|all] [--budgets 45 90 180] [--seeds 0]
    .venv/bin/python bench/quality.py --quick          # tiny random target and dataset, ~2 min
    .venv/bin/python bench/quality.py --config configs/demo.yaml --part budgets
                                                       # -> results/quality.* (the demo's real model)
    .venv/bin/python bench/quality.py --part budgets --budgets 300 --online   # + the heads in vLLM
    .venv/bin/python bench/quality.py --config configs/demo.yaml --part data --sizes 72 144 --ablation-budget 400
    # a grown dataset of the demo's prompt mix (1,000 train answers) and its data-size rows
    .venv/bin/peagle data configs/demo.yaml --set name=demo-1k --set data.max_samples=1032 --set 'data.sources=[
        {kind: jsonl, path: data/prompts/code_train.jsonl, schema: messages},
        {kind: magpie, path: ./.peagle/prompts/demo-1k-magpie.jsonl, max_samples: 516}]'
    .venv/bin/python bench/quality.py --config configs/demo.yaml --data-dir .peagle/runs/demo-1k/data \
        --part data --sizes 288 1000 --ablation-budget 400 --seeds 0 1
    .venv/bin/python bench/quality.py --config configs/demo.yaml --part copying
    .venv/bin/python bench/quality.py --render-only    # re-print results/quality.json
    .venv/bin/python bench/quality.py --part budgets --budgets 360 --online-saved   # serve heads trained before
    .venv/bin/python bench/quality.py --config my.yaml --part budgets --step-seconds peagle=0.28 eagle3=0.53
                                                       # budgets as an idle run's steps, whatever the load
    .venv/bin/python bench/quality.py --part budgets --budgets 20 60 --clock --set train.recipe.precision=bf16
                                                       # a GPU of its own: each budget on the pipeline's clock
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result_files import per_target_name, result_path  # noqa: E402
from train_common import (  # noqa: E402
    OFFLINE_NOTE,
    Run,
    cpu_model,
    epochs_override,
    head_parser,
    offline_acceptance,
    setup_head_bench,
    target_info,
    tiny_head_dataset,
    train_fresh,
)

NAME = "quality"
# The P-EAGLE recipe fields (peagle.methods.peagle's own train fields) the ablation starts from.
OLD_RECIPE = {"train.peagle.freeze_lm_head": False, "train.peagle.train_embeddings": "all",
              "train.peagle.mask_hidden_init_std": 0.02, "train.peagle.k_train": 6, "train.peagle.depth0_loss_share": None,
              "train.recipe.batch_size": 4, "train.recipe.learning_rate": 1e-3,
              "train.recipe.unaccepted_weight": 1.0}
# Each ablation row adds one choice to the row before it.
ABLATION = [
    ("starting recipe (all trainable, mask_hidden std 0.02)", {}),
    ("+ lm_head frozen", {"train.peagle.freeze_lm_head": True}),
    ("+ embeddings: mask row only", {"train.peagle.train_embeddings": "mask_row"}),
    ("+ mask_hidden std 1", {"train.peagle.mask_hidden_init_std": 1.0}),
    ("+ k_train 8", {"train.peagle.k_train": 8}),
    ("+ depth 0 half the loss", {"train.peagle.depth0_loss_share": 0.5}),
    ("+ batch_size 1 (4x the optimizer steps)", {"train.recipe.batch_size": 1}),
    ("+ lr 3e-3", {"train.recipe.learning_rate": 3e-3}),
    ("+ no loss on drafts verification never reads", {"train.recipe.unaccepted_weight": 0.0}),
]
# A variant key, not a config field: that share of the budget trains an EAGLE-3 head first, and
# the P-EAGLE run warm starts from it (train.init_from) for the rest (staged training).
STAGED = "staged_eagle3_share"
# Each variant changes ONE thing of the config's P-EAGLE recipe; its row's delta is against the
# config recipe at the same budget and seed (candidates for the config's and the code's defaults).
VARIANTS = [
    # What the mask slots' inputs cost: each slot given the token before its target, as an
    # EAGLE-3 step has it. An upper bound for one-pass drafting on the same data (not servable):
    # reaching EAGLE-3 means the gap is information; falling short means the slots' path is at fault.
    ("mask slots given the true previous token (upper bound)", {"train.peagle.mask_slot_inputs": "true_previous"}),
    ("cross-entropy on the target's token (not KL)", {"train.recipe.loss": "cross_entropy"}),
    ("embeddings: every row trains", {"train.peagle.train_embeddings": "all"}),
    ("4 drafter layers", {"drafter.num_layers": 4}),
    ("6 drafter layers", {"drafter.num_layers": 6}),
    # The paper trains deeper than it serves (K_train 8, served at 5: +3-4%).
    ("k_train 8 (three deeper than served)", {"train.peagle.k_train": 8}),
    ("AdamW on every weight (no Muon)", {"train.recipe.optimizer": "adamw"}),
    ("lm_head trains (as EAGLE-3's does)", {"train.peagle.freeze_lm_head": False}),
    ("depth 0 at its uniform share", {"train.peagle.depth0_loss_share": None}),
    # Greedy verification reads a depth's draft only where every shallower one was right; the
    # config charges no loss elsewhere. This variant charges every draft alike.
    ("every draft's loss counts, read by verification or not", {"train.recipe.unaccepted_weight": 1.0}),
    ("staged: EAGLE-3 for half the budget, then P-EAGLE from its head", {STAGED: 0.5}),
    # The paper's optimizer recipe, which the configs of the paper's models keep (tuned for tens of epochs).
    ("AdamW at the paper's peak lr 1e-4, warmup 0.0025 (no Muon)",
     {"train.recipe.optimizer": "adamw", "train.recipe.learning_rate": 1e-4, "train.recipe.warmup_ratio": 0.0025}),
]
RECIPE_LABEL = "config recipe"
CALIBRATION_STEPS = 25
# Every head is measured at K = 5, the paper's serving K and the one the quality goals name, whatever
# K the config serves (the demo's serves 3): each row's acceptance is comparable with every other's.
MEASURED_K = {"train.peagle.k_train": 5, "train.eagle3.ttt_steps": 5}
QUICK_OVERRIDES = {"drafter.num_layers": 1, "train.eagle3.num_layers": 1, "train.peagle.k_train": 3, "train.eagle3.ttt_steps": 3,
                   "train.recipe.max_len": 64,
                   "train.recipe.learning_rate": 3e-3, "train.recipe.warmup_ratio": 0.1, "train.recipe.batch_size": 1,
                   "data.max_seq_len": 256, "vllm.max_model_len": 512, "eval.num_prompts": 4, "eval.max_tokens": 32,
                   "eval.ks": [1, 3]}


# ----------------------------------------------------------------------------- measuring


def step_seconds(history: list[dict]) -> list[float]:
    return [r["step_time_s"] for r in history if "step_time_s" in r]


def calibrate(cfg_for, target, data_dir: Path) -> float:
    """Mean seconds per optimizer step of a short run (its first step, which warms up, left out).

    The mean, over a couple of dozen samples: a step's time follows its sample's length (and,
    for P-EAGLE, how many COD elements it draws), so the median of a few steps sets budgets
    that real runs overshoot."""
    from peagle.config import load_config  # noqa: F401 (cfg_for builds configs)

    trained, _ = train_fresh(cfg_for({"train.recipe.max_steps": CALIBRATION_STEPS, "train.recipe.epochs": 1}), target, data_dir)
    return statistics.fmean(step_seconds(trained.metrics_history)[1:])


def measure(cfg, target, data_dir: Path, mlflow_run_id: str | None = None) -> dict:
    from peagle.catalogue import describe
    from peagle.checkpoint_format import read_head_spec
    from peagle.train.budget import counted_seconds

    trained, wall = train_fresh(cfg, target, data_dir, mlflow_run_id)
    seconds = step_seconds(trained.metrics_history)
    last = [r for r in trained.metrics_history if "loss" in r][-1]
    t = cfg.train
    spec = read_head_spec(trained.last_checkpoint)  # the shape it really trained (drafter.* None: the target's)
    # "train s" as the pipeline's clock counts it: the first step compiles Muon's update (longer or
    # shorter by whether the inductor cache is warm), which is not training. Runs that record no
    # first_step_seconds counted it.
    return {"steps": len(seconds), "train_seconds": counted_seconds(trained.metrics_history),
            "first_step_seconds": seconds[0] if seconds else None, "wall_seconds": wall, "final_loss": last["loss"],
            "warm_start": trained.warm_start,
            "train": {"lr": t.recipe.learning_rate, "grad_accum": t.grad_accum, "k_train": t.peagle.k_train,
                      "eagle3_ttt_steps": t.eagle3.ttt_steps, "layers": describe(t.method).num_layers(cfg),
                      "optimizer": t.recipe.optimizer, "muon_lr": t.recipe.muon_learning_rate,
                      "heads": spec.num_heads, "kv_heads": spec.num_kv_heads,
                      "unaccepted_weight": t.recipe.unaccepted_weight, "loss": t.recipe.loss,
                      "mask_slot_inputs": spec.mask_slot_inputs},
            "final_train_acc": {k[len("acc/depth_"):]: v for k, v in last.items() if k.startswith("acc/depth_")},
            "checkpoint": str(trained.last_checkpoint), "train_answers": train_answers(cfg, data_dir),
            **offline_acceptance(cfg, target, data_dir, trained.last_checkpoint)}


def train_answers(cfg, data_dir: Path) -> int:
    """Answers the run trained on: train.recipe.max_samples, or the whole train split."""
    from peagle.data.store import ShardReader
    from peagle.layout import DataLayout

    return cfg.train.recipe.max_samples or len(ShardReader(DataLayout(data_dir).train, verify=False))


def reevaluate(bench: Bench, runs: list[dict]) -> list[dict]:
    """The saved runs that record no n-gram comparison and whose checkpoints are still here,
    evaluated offline again (the rest of each row kept)."""
    again = []
    for r in runs:
        if r.get("versus_ngram") or not Path(r["checkpoint"]).is_dir():
            continue
        cfg = bench.cfg(r["method"], {}, {}, "copying")
        again.append({**r, "train_answers": r.get("train_answers") or train_answers(cfg, bench.data_dir),
                      **offline_acceptance(cfg, bench.target, bench.data_dir, Path(r["checkpoint"]))})
        print(f"[quality] copying {r['part']} {r['recipe']} {r['method']} seed {r['seed']}: n-gram AL "
              f"{again[-1]['ngram_acceptance_length']}, head AL {again[-1]['acceptance_length']}", flush=True)
    return again


def parse_step_seconds(pairs: list[str] | None) -> dict[str, float]:
    """``--step-seconds METHOD=S`` pairs -> {method: seconds per step}, checked before anything trains."""
    from peagle.catalogue import available_methods

    given: dict[str, float] = {}
    for pair in pairs or []:
        method, sep, value = pair.partition("=")
        if not sep or method not in available_methods():
            raise ValueError(f"--step-seconds {pair!r}: expected METHOD=SECONDS with METHOD one of "
                             f"{', '.join(available_methods())} (e.g. peagle=0.28)")
        try:
            seconds = float(value)
        except ValueError:
            seconds = 0.0
        if not seconds > 0:
            raise ValueError(f"--step-seconds {pair!r}: SECONDS must be a positive number")
        given[method] = seconds
    return given


def answers_per_step(train) -> int:
    """Answers (samples) one optimizer step trains on, on one rank: what a step's time grows with."""
    return train.recipe.micro_batch_size * train.grad_accum


class Bench:
    """Runs keyed by (part, recipe, method, budget, seed), each head trained once: a row whose
    config (recipe, steps, seed) an earlier row trained shares that row's run. Step-time
    calibration per recipe, unless a method's seconds per step are given (``--step-seconds``):
    then a budget is the same number of steps whatever else the machine is running, e.g. an
    idle run's steps on a second dataset."""

    def __init__(self, config: str, base: dict, target, data_dir: Path, work: Path, ks: list[int],
                 given_step_s: dict[str, float] | None = None, clock: bool = False, experiment: str = NAME):
        self.config, self.base, self.target, self.data_dir, self.work, self.ks = config, base, target, data_dir, work, ks
        self.experiment = f"peagle-bench-{experiment}"  # the MLflow experiment of its runs
        self.step_s: dict[str, float] = {}
        self.given_step_s = dict(given_step_s or {})
        self.clock = clock
        self.trained: dict[str, dict] = {}  # a run's row by the config it trained: one training a head
        self.recorded = {"target_revision": self.target_revision(), "data_build": dataset_build(data_dir),
                         "data_dir": str(Path(data_dir).resolve()), "cpu": cpu_model()}

    def target_revision(self) -> str:
        """Which build of the target the runs measure (a local target's content digest, as the
        pipeline's lineage records it): each machine builds the embedded target itself."""
        from peagle.config import load_config
        from peagle.lineage import target_revision

        return target_revision(load_config(self.config).target, str(self.target.path)).value

    def seconds_per_step(self, method: str, recipe: dict) -> tuple[float, str]:
        """The step time a budget is divided by, and where it came from ("given" or "calibration").

        A given time is the config recipe's step; a recipe that trains more answers per optimizer
        step (``train.recipe.batch_size``) takes that many times as long a step."""
        keyed = self.cfg(method, recipe, {}, "key")
        if method in self.given_step_s:
            config_step = self.cfg(method, {}, {}, "key").train
            return self.given_step_s[method] * answers_per_step(keyed.train) / answers_per_step(config_step), "given"
        key = keyed.train.model_dump_json() + keyed.drafter.model_dump_json()  # the recipe and shape as trained
        if key not in self.step_s:
            self.step_s[key] = calibrate(lambda extra: self.cfg(method, recipe, extra, "calibration"),
                                         self.target, self.data_dir)
        return self.step_s[key], "calibration"

    def cfg(self, method: str, recipe: dict, extra: dict, tag: str):
        from peagle.config import load_config

        # Every head trains the steps of its own budget: no pipeline baseline beside it, and no
        # same_time rule (which would look for a P-EAGLE head in this config's run directory to
        # time an EAGLE-3 head, e.g. when the online step exports one).
        # A run is held to its budget by a step count (or by --clock, which sets the clock in extra),
        # not by the config's own clock.
        overrides = {**self.base, **recipe, "train.method": method, "train.baseline.eagle3": False,
                     "train.baseline.budget": "same_steps", "train.recipe.max_train_seconds": None,
                     "eval.ks": self.ks, **extra, "workdir": str(self.work / tag)}
        return load_config(self.config, overrides)

    def staged(self, part: str, label: str, share: float, budget: float, seed: int) -> dict:
        """EAGLE-3 for ``share`` of ``budget``, exported, then P-EAGLE warm started from that head
        for the rest: one row, its training seconds both stages' (the EAGLE-3 stage kept in it)."""
        from peagle.stages import export_head

        same_depth = {"train.eagle3.num_layers": None}  # the P-EAGLE stage starts from this head's layers
        first = self.run(part, f"{label} [stage 1]", "eagle3", same_depth, budget * share, seed)
        head = export_head(self.cfg("eagle3", same_depth, {}, f"{part}-staged-{seed}"), self.target, self.data_dir,
                           Path(first["checkpoint"]), method="eagle3")
        second = self.run(part, label, "peagle", {"train.init_from": str(head)}, budget * (1 - share), seed)
        stage1 = {k: first[k] for k in ("steps", "train_seconds", "budget_s", "acceptance_length", "checkpoint")}
        return {**second, "overrides": {STAGED: share}, "budget_s": budget, "stage1_eagle3": stage1,
                "train_seconds": first["train_seconds"] + second["train_seconds"],
                "wall_seconds": first["wall_seconds"] + second["wall_seconds"]}

    def budget_overrides(self, method: str, recipe: dict, budget: float) -> tuple[dict, float | None, str]:
        """How a run is held to ``budget`` seconds: a step count (budget / step time), or with
        ``--clock`` the pipeline's own clock (``train.recipe.max_train_seconds``); the step time used and
        its source ("calibration", "given" or "clock")."""
        if self.clock:
            return {"train.recipe.max_train_seconds": budget}, None, "clock"
        step_s, source = self.seconds_per_step(method, recipe)
        return {"train.recipe.max_steps": max(2, math.ceil(budget / step_s))}, step_s, source

    def run(self, part: str, label: str, method: str, recipe: dict, budget: float, seed: int) -> dict:
        held, step_s, source = self.budget_overrides(method, recipe, budget)
        cfg = self.cfg(method, recipe, {**held, "train.recipe.seed": seed}, f"{part}-{method}-{seed}")
        trained_as = cfg.model_dump_json(exclude={"workdir"})  # everything the head is, but where it is written
        if trained_as in self.trained:  # e.g. the budgets part's config recipe, trained by the variants part
            first = self.trained[trained_as]
            print(f"[quality] {part} {label} {method} budget {budget}s seed {seed}: the head of "
                  f"{first['part']} | {first['recipe']}, trained as it", flush=True)
            return {**first, "part": part, "recipe": label, "overrides": recipe,
                    "same_training_as": f"{first['part']} | {first['recipe']}"}
        tracked = BenchRun.start(cfg.tracking, self.experiment, f"{part} | {label} | {method} | {budget:g} s | seed {seed}")
        try:
            measured = measure(cfg, self.target, self.data_dir, tracked.run_id)
        except BaseException:
            tracked.logger.client.set_terminated(tracked.run_id, "FAILED")
            raise
        row = {"part": part, "recipe": label, "overrides": recipe, "method": method, "budget_s": budget, "seed": seed,
               "calibrated_step_s": step_s, "step_s_source": source, **self.recorded, **measured,
               "mlflow_run_id": tracked.run_id}
        tracked.finish(row)
        self.trained[trained_as] = row
        print(f"[quality] {part} {label} {method} budget {budget}s seed {seed}: {row['steps']} steps, "
              f"{row['train_seconds']:.0f} s, AL {row['acceptance_length']}", flush=True)
        return row


class BenchRun:
    """One bench run as an MLflow run (the pipeline's own ``RunLogger``)."""

    def __init__(self, logger):
        self.logger = logger

    @property
    def run_id(self) -> str:
        return self.logger.run_id

    @classmethod
    def start(cls, tracking, experiment: str, name: str) -> BenchRun:
        from peagle.tracking.mlflow_run import RunLogger, ensure_experiment, make_client, resolve_tracking_uri

        uri = resolve_tracking_uri(tracking)
        client = make_client(uri)
        run = client.create_run(ensure_experiment(client, experiment, uri), run_name=name)
        return cls(RunLogger(client, run.info.run_id))

    def finish(self, row: dict) -> None:
        """The row's recipe as params, its numbers as metrics, the row itself as ``run.json``."""
        self.logger.log_params({"part": row["part"], "recipe": row["recipe"], "method": row["method"],
                                "budget_s": row["budget_s"], "seed": row["seed"], "overrides": row["overrides"],
                                "train": row.get("train") or {}})
        self.logger.set_tags({"cpu": row.get("cpu", ""), "target_revision": row.get("target_revision", ""),
                              "offline_split": row.get("offline_split", "")})
        numbers = {"steps": row["steps"], "train_seconds": row["train_seconds"], "wall_seconds": row["wall_seconds"],
                   "final_loss": row["final_loss"], "train_answers": row.get("train_answers") or 0,
                   **{f"acceptance_length_k{k}": v for k, v in row["acceptance_length"].items()},
                   **{f"ngram_acceptance_length_k{k}": v for k, v in row.get("ngram_acceptance_length", {}).items()}}
        self.logger.log_metrics(numbers)
        self.logger.client.log_dict(self.run_id, row, "run.json")
        self.logger.client.set_terminated(self.run_id)


ONLINE_K, ONLINE_CONCURRENCY = 5, [1, 4]


def confirm_online(bench: Bench, runs: list[dict]) -> list[dict]:
    """Serve each method's head of the largest budget (its last budgets run) in vLLM, with no
    speculation beside them: one record per method, K and concurrency (``OnlineRow`` fields plus
    the budget, the offline acceptance at that K and the speed-up)."""
    from peagle.catalogue import describe
    from peagle.stages import evaluate_online, export_head

    last = {r["method"]: r for r in runs if r["part"] == "budgets"}  # dict order: the last run wins
    k = min(ONLINE_K, max(bench.ks))
    cfg = bench.cfg("peagle", {}, {"eval.ks": [k], "eval.concurrency": ONLINE_CONCURRENCY}, "online")
    heads = {m: export_head(cfg, bench.target, bench.data_dir, Path(r["checkpoint"]), method=m)
             for m, r in last.items()}
    result = evaluate_online(cfg, bench.target, heads)
    by_label = {describe(m).label: m for m in last}
    records = []
    for table, traffic in ((result, "chat"), (result.completion, "completion")):
        for row in table.rows if table else []:
            run = last.get(by_label.get(row.method))
            records.append({"traffic": traffic, "method": row.method, "k": row.k, "concurrency": row.concurrency,
                            "budget_s": run["budget_s"] if run else None,
                            "offline_al": run["acceptance_length"][str(k)] if run and traffic == "chat" else None,
                            "acceptance_length": row.acceptance_length, "per_position": row.per_position_acceptance,
                            "output_tokens_per_s": row.output_tokens_per_s, "speedup": table.speedup(row)})
    return records


def saved_heads(runs: list[dict], budget: float, seed: int) -> list[dict]:
    """The saved budgets runs of one budget and seed whose checkpoints are still here (in the
    order they ran, so ``confirm_online`` serves each method's latest)."""
    found = [r for r in runs if r["part"] == "budgets" and r["budget_s"] == budget and r["seed"] == seed
             and Path(r["checkpoint"]).is_dir()]
    if not found:
        raise SystemExit(f"--online-saved: no saved budgets run at {budget:g} s, seed {seed} with its checkpoint "
                         "on this machine; train one with --part budgets first")
    return found


def run_key(r: dict) -> tuple:
    """A later run replaces an earlier one of the same key: "config recipe" runs of another recipe,
    and runs on another build of the target, stay."""
    return (r["part"], r["recipe"], r["method"], r["budget_s"], r["seed"], trained_as(r), setting(r).target)


def merged(old: list[dict], new: list[dict]) -> list[dict]:
    """Earlier runs plus the new ones; a new run replaces an old one with the same key."""
    fresh = {run_key(r) for r in new}
    return [r for r in old if run_key(r) not in fresh] + new


# ----------------------------------------------------------------------------- tables and plot


# Runs that record no offline split counted acceptance per anchor of the held-out split instead
# of walking the served split as vLLM decodes (``peagle.eval.offline``): their numbers are kept,
# marked, never averaged with the served walk's.
OLD_OFFLINE = "held-out, per anchor"


def offline_kind(run: dict) -> str:
    return run.get("offline_split") or OLD_OFFLINE


# Runs that record no target build: which build they measured is not known.
UNRECORDED_TARGET = "unrecorded"


def dataset_build(data_dir: Path) -> str | None:
    """Which dataset a run trained and was measured on: the hash of the data configuration that
    built it (its ``lineage.json``), the same on every machine that builds it from that config;
    None for a dataset the pipeline did not build (--quick's)."""
    from peagle.lineage import read_dataset_inputs

    return read_dataset_inputs(data_dir).get("data_config_hash")


class Setting(NamedTuple):
    """What two runs must share for their acceptance to be compared or averaged: how it was
    simulated, and the ground: the target build and, where a run records it, the dataset. The
    embedded target is built on each machine, and the same recipe, steps and seed accept
    differently on a machine with another CPU, so each run also records its CPU."""

    split: str
    target: str

    def label(self, many_targets: bool) -> str:
        return f"{self.split}, target {self.target}" if many_targets else self.split

    def tag(self, row_label: str, many_targets: bool) -> str:
        """A table row's label, naming the target build where the file holds more than one."""
        return f"{row_label} [target {self.target}]" if many_targets else row_label


def setting(run: dict) -> Setting:
    target = run.get("target_revision") or UNRECORDED_TARGET
    return Setting(offline_kind(run), f"{target}, data {run['data_build']}" if run.get("data_build") else target)


def several_targets(runs: list[dict]) -> bool:
    return len({setting(r).target for r in runs}) > 1


def mean_by(runs: list[dict], keys: tuple[str, ...]) -> dict[tuple, dict]:
    """Per group (``keys`` of a run, and its ``Setting``): mean acceptance per K, mean train
    seconds, number of seeds."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((*(trained_as(r) if k == "trained_as" else r[k] for k in keys), setting(r)), []).append(r)
    return {g: {"al": {k: statistics.fmean(r["acceptance_length"][k] for r in rs) for k in rs[0]["acceptance_length"]},
                "pos": [statistics.fmean(p) for p in zip(*(r["per_position"] for r in rs))],
                "train_s": statistics.fmean(r["train_seconds"] for r in rs),
                "steps": statistics.fmean(r["steps"] for r in rs), "seeds": len(rs),
                "trained": " / ".join(dict.fromkeys(trained_as(r) for r in rs)),
                "optimizers": {optimizer_of(r) for r in rs},
                "off_chain": {off_chain_weight(r) for r in rs}}
            for g, rs in groups.items()}


def optimizer_of(run: dict) -> str:
    """The optimizer a run recorded (a run that records none trained with AdamW)."""
    return (run.get("train") or {}).get("optimizer", "adamw")


def off_chain_weight(run: dict) -> float:
    """The loss weight of drafts verification never reads (a run that records none weighed
    every supervised element alike, unless its overrides said otherwise)."""
    t = run.get("train") or {}
    return t.get("unaccepted_weight", (run.get("overrides") or {}).get("train.recipe.unaccepted_weight", 1.0))


def trained_as(run: dict) -> str:
    """The recipe a run really trained with: "config recipe" rows of different invocations differ."""
    t = run.get("train")
    if not t:
        return "?"
    depth = f"TTT {t['eagle3_ttt_steps']}" if run["method"] == "eagle3" else f"K_train {t['k_train']}"
    optimizer = f", Muon {t['muon_lr']:g}" if optimizer_of(run) == "muon" else ""
    # A run that records no kv_heads trained the target's attention shape (3 query heads sharing
    # one KV head on the embedded target), unless the row's label says otherwise.
    attention = f", {t['heads']}q/{t['kv_heads']}kv heads" if "kv_heads" in t else ""
    weight = off_chain_weight(run)
    off_chain = f", off-chain loss x{weight:g}" if weight < 1.0 else ""
    loss = ", cross-entropy" if t.get("loss", "kl") == "cross_entropy" else ""
    slots = ", true previous tokens in the mask slots" if t.get("mask_slot_inputs", "mask") != "mask" else ""
    return (f"{depth}, lr {t['lr']:g}{optimizer}, {t['layers']} layer{'' if t['layers'] == 1 else 's'}{attention}"
            f"{off_chain}{loss}{slots}")


def train_seconds_note(runs: list[dict]) -> str:
    """What "train s" counts; runs that record no first step counted it (see ``measure``)."""
    counted_first = any("first_step_seconds" not in r for r in runs if r["part"] == "budgets")
    return ("mean over seeds; train s = the run's summed step times (no launch, no evaluation, no first step of a "
            "process, which compiles" + ("; runs that record no first step include it" if counted_first else "") + ")")


def add_tables(run: Run, meta: dict) -> None:
    ks = [str(k) for k in meta["ks"]]
    many = several_targets(meta["runs"])
    budgets = mean_by([r for r in meta["runs"] if r["part"] == "budgets"], ("method", "budget_s", "trained_as"))
    if budgets:
        rows = [[m, f"{b:g}", v["trained"], f"{v['train_s']:.0f}", f"{v['steps']:.0f}", v["seeds"],
                 *[f"{v['al'][k]:.3f}" for k in ks], " ".join(f"{p:.2f}" for p in v["pos"]), split.label(many)]
                for (m, b, _, split), v in sorted(budgets.items(), key=lambda kv: (
                    kv[0][3].split == OLD_OFFLINE, kv[0][3].target, kv[0][1], kv[0][2], kv[0][0]))]
        run.add_table("Offline acceptance length per K at equal training time (the config's recipes)",
                      ["method", "budget s", "trained as", "train s", "steps", "seeds", *[f"K={k}" for k in ks],
                       "per position", "offline split" + (", target" if many else "")],
                      rows, note=train_seconds_note(meta["runs"]))
    ablation = mean_by([r for r in meta["runs"] if r["part"] == "ablation"], ("recipe", "method", "budget_s"))
    if ablation:
        order = [label for label, _ in ABLATION] + [RECIPE_LABEL]
        rows, previous, previous_target = [], None, None
        for (label, method, budget, where), v in sorted(ablation.items(), key=lambda kv: (
                kv[0][3].target, kv[0][1] != "peagle", order.index(kv[0][0]) if kv[0][0] in order else len(order))):
            k5 = ks[min(len(ks), 5) - 1]
            if where.target != previous_target:  # each build's rows add to its own rows only
                previous, previous_target = None, where.target
            delta = "" if previous is None or method != "peagle" else f"{v['al'][k5] - previous:+.3f}"
            rows.append([where.tag(label, many), method, f"{budget:g}",
                         f"{v['train_s']:.0f}", f"{v['steps']:.0f}",
                         *[f"{v['al'][k]:.3f}" for k in ks], delta, " ".join(f"{p:.2f}" for p in v["pos"])])
            if method == "peagle":
                previous = v["al"][k5]
        run.add_table("Ablation: P-EAGLE recipe choices at one budget (each row adds one choice to the row above)",
                      ["recipe", "method", "budget s", "train s", "steps", *[f"K={k}" for k in ks],
                       f"delta K={ks[min(len(ks), 5) - 1]}", "per position"], rows,
                      note="the eagle3 row is the baseline at the same budget; offline split: "
                           + ", ".join(sorted({split.split for *_, split in ablation})))
    add_variants_table(run, meta, ks)
    add_data_table(run, meta, ks)
    add_projection_table(run, meta, ks)
    add_copying_table(run, meta)
    add_online_table(run, meta)


def add_data_table(run: Run, meta: dict, ks: list[str]) -> None:
    """Acceptance against the answers trained on: the data part's runs, and the config recipe's
    P-EAGLE runs of the same steps on the whole train split (the budgets and variants parts');
    rows of each target build and dataset apart."""
    sized = [r for r in meta["runs"] if r["part"] == "data"]
    if not sized:
        return
    steps = {r["steps"] for r in sized}
    whole = [r for r in meta["runs"] if r["method"] == "peagle" and r["steps"] in steps and r["recipe"] == RECIPE_LABEL
             and r["part"] in ("budgets", "variants")]
    groups: dict[tuple, list[dict]] = {}
    for r in sized + whole:
        groups.setdefault((setting(r), r["steps"], answers_trained(r)), []).append(r)
    many = several_targets(sized + whole)
    k5 = ks[min(len(ks), 5) - 1]
    rows = [[where.tag(str(n or "all"), True) if many else n or "all", steps_, f"{steps_ / n:.1f}" if n else "", len(rs),
             f"{statistics.fmean(r['train_seconds'] for r in rs):.0f}",
             *[f"{statistics.fmean(r['acceptance_length'][k] for r in rs):.3f}" for k in ks],
             " / ".join(f"{r['acceptance_length'][k5]:.3f}" for r in rs)]
            for (where, steps_, n), rs in sorted(groups.items(), key=lambda kv: (
                kv[0][0].target, kv[0][1], kv[0][2] or math.inf))]
    run.add_table("Data size: the config's P-EAGLE recipe on the first N answers, for the same steps",
                  ["answers", "steps", "epochs", "seeds", "train s", *[f"K={k}" for k in ks],
                   f"K={k5} per seed"], rows,
                  note="the whole train split's row is the config recipe's P-EAGLE run of the same steps "
                       "(the budgets or variants part's)")


# The acceptance length the projection also reads a time off for, beside n-gram lookup's on the
# same tokens (the floor a head must clear to be worth training): the goal on chat.
GOAL_AL = 2.5


def log_time_fit(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """Least squares ``al = a + b * log2(seconds)`` through (seconds, al) points -> (a, b, the
    largest residual)."""
    xs, ys = [math.log2(s) for s, _ in points], [al for _, al in points]
    b, a = statistics.linear_regression(xs, ys)
    return a, b, max(abs(y - (a + b * x)) for x, y in zip(xs, ys))


def seconds_to_reach(al: float, a: float, b: float) -> float | None:
    """Training seconds at which the fitted line reaches ``al`` (None: it never does)."""
    return 2 ** ((al - a) / b) if b > 0 else None


def hours(seconds: float) -> str:
    """``0.22 h``, ``3.5 h``, ``1,300 h``: two significant digits, no exponent."""
    h = float(f"{seconds / 3600:.2g}")
    return f"{h:,.{max(0, 1 - math.floor(math.log10(h)))}f} h"


def add_projection_table(run: Run, meta: dict, ks: list[str]) -> None:
    """What more training would take: per method and recipe with three or more budgets, a line
    through acceptance at the largest K against log2(training seconds), and the seconds at which it
    reaches n-gram lookup's acceptance on the same tokens and the goal (an extrapolation)."""
    k5 = ks[min(len(ks), 5) - 1]
    runs = [r for r in meta["runs"] if r["part"] == "budgets" and r["acceptance_length"].get(k5)]
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["method"], trained_as(r), setting(r)), []).append(r)
    rows = []
    for (method, trained, _), rs in sorted(groups.items(), key=lambda kv: (kv[0][0] != "peagle", kv[0][1])):
        means = mean_by(rs, ("budget_s",))
        if len(means) < 3:
            continue
        a, b, worst = log_time_fit([(v["train_s"], v["al"][k5]) for v in means.values()])
        ngram = [r["ngram_acceptance_length"][k5] for r in rs if r.get("ngram_acceptance_length")]
        step_s = statistics.fmean(r["calibrated_step_s"] for r in rs)
        row = [method, trained, " ".join(f"{budget:g}" for (budget, _), _ in sorted(means.items())), f"{b:+.3f}",
               f"{worst:.3f}"]
        for target in (statistics.fmean(ngram) if ngram else None, GOAL_AL):
            need = None if target is None else seconds_to_reach(target, a, b)
            row += ["" if target is None else f"{target:.2f}",
                    "never" if need is None else f"{hours(need)} ({need / step_s:,.0f} steps)"]
        rows.append(row)
    if rows:
        run.add_table(f"What more training would take: AL at K={k5} against log2(training seconds), extrapolated",
                      ["method", "trained as", "budgets fitted (s)", "AL per doubling", "largest residual",
                       "n-gram AL", "time to reach it here", "goal AL", "time to reach it here"], rows,
                      note="a least-squares line through each budget's mean over seeds; time on this machine's "
                           "steps (the calibrated seconds per step); the line is a projection from the measured "
                           "budgets, not a measurement, and gains per doubling usually shrink as training goes on")


def answers_trained(run: dict) -> int:
    """Answers a run trained on: its train.recipe.max_samples, or the whole train split."""
    return int((run.get("overrides") or {}).get("train.recipe.max_samples") or run.get("train_answers") or 0)


def add_copying_table(run: Run, meta: dict) -> None:
    """Per run group: n-gram lookup's and the head's acceptance at the largest K on the same tokens,
    and per draft position the share n-gram lookup drafts right and the head's accuracy there and
    elsewhere (``peagle.eval.offline``'s ``versus_ngram``)."""
    measured = [r for r in meta["runs"] if r.get("versus_ngram")]
    if not measured:
        return
    groups: dict[tuple, list[dict]] = {}
    for r in measured:
        groups.setdefault((r["part"], r["recipe"], r["method"], r["budget_s"], answers_trained(r), trained_as(r)),
                          []).append(r)
    # A label several recipes trained under (the budgets part's "config recipe" of invocations with
    # other --set overrides) names each recipe as it trained.
    recipes_of: dict[tuple, set[str]] = {}
    for key in groups:
        recipes_of.setdefault(key[:5], set()).add(key[5])
    rows = []
    for (part, label, method, budget, answers, trained), rs in sorted(groups.items(), key=lambda kv: (
            kv[0][0] != "budgets", kv[0][0], kv[0][3], kv[0][1], kv[0][2], kv[0][5])):
        if len(recipes_of[(part, label, method, budget, answers)]) > 1:
            label = f"{label} ({trained})"
        k = max(rs[0]["acceptance_length"], key=int)

        def mean(key: str, i: int, rs=rs) -> float:
            return statistics.fmean(r["versus_ngram"][key][i] for r in rs)

        depths = range(len(rs[0]["versus_ngram"]["ngram_right"]))
        rows.append([part, label, method, f"{budget:g}", answers or "all", len(rs),
                     f"{statistics.fmean(r['ngram_acceptance_length'][k] for r in rs):.2f}",
                     f"{statistics.fmean(r['acceptance_length'][k] for r in rs):.2f}",
                     " ".join(f"{mean('ngram_right', i):.2f}" for i in depths),
                     " ".join(f"{mean('head_right_where_ngram_right', i):.2f}" for i in depths),
                     " ".join(f"{mean('head_right_where_ngram_wrong', i):.2f}" for i in depths)])
    run.add_table("Copying: each head beside vLLM's n-gram lookup on the same tokens, per draft position",
                  ["part", "recipe", "method", "budget s", "answers", "seeds", "n-gram AL", "head AL",
                   "n-gram right (share)", "head right where n-gram right", "head right where n-gram wrong"], rows,
                  note="AL at the largest K, both walked as vLLM decodes on the served split; per position k = "
                       "1..K over every drafting anchor (not only where the earlier drafts were accepted)")


def add_online_table(run: Run, meta: dict) -> None:
    """The largest budget's heads in vLLM: acceptance (offline beside it), tokens/s, speed-up."""
    records = meta.get("online") or []
    if not records:
        return
    eagle3 = {(r["traffic"], r["concurrency"]): r["output_tokens_per_s"] for r in records if r["method"] == "eagle-3"}
    rows = []
    for r in records:
        al = "" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
        offline = "" if r["offline_al"] is None else f"{r['offline_al']:.2f}"
        vs_eagle3 = eagle3.get((r["traffic"], r["concurrency"]))
        rows.append([r["traffic"], r["method"], "" if r["budget_s"] is None else f"{r['budget_s']:g}",
                     r["k"] or "-", r["concurrency"], al, offline, " ".join(f"{p:.2f}" for p in r["per_position"]),
                     f"{r['output_tokens_per_s']:.1f}", "" if r["speedup"] is None else f"{r['speedup']:.2f}x",
                     f"{r['output_tokens_per_s'] / vs_eagle3:.2f}x" if vs_eagle3 and r["k"] else ""])
    run.add_table("The largest budget's heads in vLLM (the pipeline's online evaluation)",
                  ["traffic", "method", "budget s", "K", "conc.", "AL vLLM", "AL offline", "per position",
                   "out tok/s", "vs no spec.", "tok/s vs EAGLE-3"], rows,
                  note="greedy, the config's eval prompts (chat) and completion prompts, max_tokens as configured")


def add_variants_table(run: Run, meta: dict, ks: list[str]) -> None:
    """One row per variant and budget, its delta at K=5 against the config recipe's row."""
    variants = mean_by([r for r in meta["runs"] if r["part"] == "variants"], ("recipe", "budget_s", "trained_as"))
    if not variants:
        return
    # Where the variants part did not train the config recipe at a budget, the budgets part's P-EAGLE
    # runs at that budget are the same recipe: the delta compares against those.
    config_runs = mean_by([r for r in meta["runs"] if r["part"] == "budgets" and r["method"] == "peagle"],
                          ("recipe", "budget_s", "trained_as"))
    order = [RECIPE_LABEL] + [label for label, _ in VARIANTS]
    k5 = ks[min(len(ks), 5) - 1]
    many = several_targets(meta["runs"])
    rows = []
    for (label, budget, _, split), v in sorted(variants.items(), key=lambda kv: (
            kv[0][3].target, kv[0][1], order.index(kv[0][0]) if kv[0][0] in order else len(order), kv[0][2])):
        # The config recipe it changed: trained with the same optimizer and off-chain weight (the
        # config's when it ran), unless the variant is the change of that.
        change = dict(VARIANTS).get(label, {})
        bases = [b for group in (variants, config_runs) for (lb, bb, _, sb), b in group.items()
                 if (lb, bb, sb) == (RECIPE_LABEL, budget, split)
                 and (b["optimizers"] != v["optimizers"]) == ("train.recipe.optimizer" in change)
                 and (b["off_chain"] != v["off_chain"]) == ("train.recipe.unaccepted_weight" in change)]
        # Rows of one budget from other invocations trained other step counts (and recipes): the
        # config recipe run for the variant's own steps, where there is one, is its base.
        base = next((b for b in bases if round(b["steps"]) == round(v["steps"])), bases[0] if bases else None)
        delta = "" if base is None or label == RECIPE_LABEL else f"{v['al'][k5] - base['al'][k5]:+.3f}"
        rows.append([split.tag(label, many), f"{budget:g}", v["trained"],
                     f"{v['train_s']:.0f}", f"{v['steps']:.0f}", v["seeds"],
                     *[f"{v['al'][k]:.3f}" for k in ks], delta, " ".join(f"{p:.2f}" for p in v["pos"])])
    run.add_table("Variants: the config's P-EAGLE recipe with one change each, at one budget",
                  ["recipe", "budget s", "trained as", "train s", "steps", "seeds", *[f"K={k}" for k in ks],
                   f"delta K={k5} vs config recipe", "per position"], rows,
                  note="mean over seeds; a delta compares runs of the same budget; a staged row's train s sums "
                       "both stages (its steps: the P-EAGLE stage's)")


def plot(meta: dict, out: Path) -> None:
    """Acceptance length at K=5 (or the largest K) against training seconds: one series per method
    and recipe (a recipe's runs joined with another's read as a trend that is not there), each run
    a point, a line through each budget's mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from peagle.fileio import atomic_path

    k = str(min(max(meta["ks"]), 5))
    runs = [r for r in meta["runs"] if r["part"] == "budgets"]
    if any(offline_kind(r) != OLD_OFFLINE for r in runs):  # one way of simulating per plot: the current one
        runs = [r for r in runs if offline_kind(r) != OLD_OFFLINE]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    many = several_targets(runs)
    series: dict[tuple[str, str, str], list[dict]] = {}
    for r in sorted(runs, key=lambda r: (r["method"] != "peagle", trained_as(r), setting(r).target)):
        series.setdefault((r["method"], trained_as(r), setting(r).target if many else ""), []).append(r)
    for (method, trained, target), mine in series.items():
        name = "P-EAGLE" if method == "peagle" else "EAGLE-3"
        trained += f", target {target}" if target else ""
        marker, line = ("o", "-") if method == "peagle" else ("s", "--")
        points = ax.scatter([r["train_seconds"] for r in mine], [r["acceptance_length"][k] for r in mine],
                            marker=marker, alpha=0.45, s=22)
        means = [v for _, v in sorted(mean_by(mine, ("budget_s",)).items())]
        ax.plot([v["train_s"] for v in means], [v["al"][k] for v in means], line, marker=marker,
                color=points.get_facecolor()[0][:3], label=f"{name}, {trained} (mean per budget)")
        for v in means:
            ax.annotate(f"{v['steps']:.0f} steps", (v["train_s"], v["al"][k]), textcoords="offset points",
                        xytext=(4, -12), fontsize=7)
    ngram = [r["ngram_acceptance_length"][k] for r in runs if (r.get("ngram_acceptance_length") or {}).get(k)]
    if ngram and not many:  # the floor a head must clear, walked on the same tokens
        ax.axhline(statistics.fmean(ngram), linestyle=":", color="gray", label="n-gram lookup on the same tokens")
    ax.set_xscale("log", base=2)  # the projection's axis: equal steps are doublings of training time
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("training seconds (summed step times, log scale)")
    ax.set_ylabel(f"offline acceptance length, K={k}")
    where = f", {meta['gpu']}" if meta.get("gpu") else ""
    ax.set_title(f"Acceptance vs training time, {meta['data_name']}{where}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def given_step_note(runs: list[dict]) -> str:
    """Which runs divided their budget by a given step time (``--step-seconds``) instead."""
    given = sorted({(r["method"], r["calibrated_step_s"]) for r in runs if r.get("step_s_source") == "given"})
    if not given:
        return ""
    return (", or by the seconds per step given with --step-seconds ("
            + ", ".join(f"{m} {s:g} s" for m, s in given) + "; their train s ran under whatever load there was)")


def clock_note(runs: list[dict]) -> str:
    """Whether some runs trained their budget on the pipeline's clock (``--clock``) instead."""
    clocked = sum(r.get("step_s_source") == "clock" for r in runs)
    if not clocked:
        return ""
    return (f"; {clocked} run(s) by --clock: train.recipe.max_train_seconds = the budget, the pipeline's own clock "
            "(summed step seconds, each process's first step left out)")


def data_note(meta: dict) -> str:
    """Where the runs' datasets are: the last invocation's, and every other dataset a run records."""
    if meta["args"].get("quick"):
        return f"data: {meta['data_dir']} (tiny random target, --quick)"
    builds = {r["data_dir"]: r["data_build"] for r in meta["runs"] if r.get("data_build")}
    builds.setdefault(str(Path(meta["data_dir"]).resolve()), None)
    return "data: " + "; ".join(f"{d} (data {b})" if b else d for d, b in sorted(builds.items()))


def notes(meta: dict) -> list[str]:
    runs = meta["runs"]
    return [
        data_note(meta),
        f"budget -> train.recipe.max_steps via a {CALIBRATION_STEPS}-step calibration run per method and recipe"
        + given_step_note(runs) + clock_note(runs) + "; "
        f"config {meta['args']['config']}; the last invocation's overrides {json.dumps(meta['base_overrides'])} "
        "(each run's own recipe: its 'trained as'); "
        f"OMP_NUM_THREADS={meta['args']['threads']}; {len(runs)} runs",
        OFFLINE_NOTE + f"; runs marked '{OLD_OFFLINE}' counted acceptance per anchor of the held-out split instead",
        f"GPU: {meta['gpu']} (one rank)" if meta.get("gpu") else
        "shared 2-core machine: step times vary with the other jobs' load (see load averages)",
    ]


# ----------------------------------------------------------------------------- main


def render(run: Run, partial: bool = False) -> None:
    run.sections = []
    add_tables(run, run.meta)
    if any(r["part"] == "budgets" for r in run.meta["runs"]):
        plot(run.meta, result_path(run.name, ".png"))
    run.finish(notes(run.meta), partial=partial)


class Results:
    """The result files of one invocation: earlier invocations' runs (and online table) kept,
    rewritten after every run, so a run stopped half way keeps the rows it finished.

    The saved runs are read again, under a lock, at every write: two invocations on one dataset
    (e.g. one per core, each with --step-seconds) both keep their runs."""

    def __init__(self, run: Run, quick: bool, meta: dict):
        self.run, self.quick, self.runs = run, quick, []
        run.meta.update(meta)

    def saved(self) -> dict:
        if self.quick or not result_path(self.run.name, ".json").exists():
            return {}
        return Run.restore(self.run.name).meta

    def add(self, row: dict) -> None:
        self.runs.append(row)
        self.write(partial=True)

    def write(self, online: list[dict] | None = None, partial: bool = False) -> None:
        with open(result_path(self.run.name, ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            saved = self.saved()
            self.run.meta["runs"] = merged(saved.get("runs", []), self.runs)
            old_online = saved.get("online")
            if online is not None or old_online:
                self.run.meta["online"] = online if online is not None else old_online
            render(self.run, partial=partial)


def result_name(config: str, quick: bool) -> str:
    """``quality`` for the demo's target (and --quick), ``quality_<config>`` for another."""
    return NAME if quick else per_target_name(NAME, config)


def main() -> None:
    parser = head_parser(__doc__)
    parser.add_argument("--part", choices=["ablation", "variants", "budgets", "data", "copying", "all"], default="all")
    parser.add_argument("--sizes", type=int, nargs="+", default=[72, 144],
                        help="the data part's train.recipe.max_samples (answers), each for the steps of --ablation-budget")
    parser.add_argument("--budgets", type=float, nargs="+", default=[45, 90, 180], help="training seconds per run")
    parser.add_argument("--ablation-budget", type=float, default=90)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--ablation-rows", type=int, nargs="+", default=None,
                        help="run only these ablation rows (0-based; each still adds the rows above it) and "
                             "skip the EAGLE-3 row; earlier rows' results are kept")
    parser.add_argument("--variants", type=int, nargs="+", default=None,
                        help="run only these rows of the variants part: 0 = the config recipe, i = the i-th variant")
    parser.add_argument("--online", action="store_true",
                        help="after the budgets part, serve each method's largest-budget head in vLLM "
                             f"(K={ONLINE_K}, concurrency {ONLINE_CONCURRENCY}) against no speculation")
    parser.add_argument("--online-saved", action="store_true",
                        help="train nothing: serve the heads of the saved budgets runs (each method's latest at "
                             "the largest --budgets and the first --seeds) in vLLM, as --online does")
    parser.add_argument("--quick", action="store_true", help="a tiny random target and dataset, tiny budgets")
    parser.add_argument("--render-only", action="store_true", help=f"re-print results/{NAME}.json")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="override a config key for every run, e.g. --set train.recipe.precision=bf16 on a GPU")
    parser.add_argument("--methods", nargs="+", choices=["peagle", "eagle3"], default=["peagle", "eagle3"],
                        help="which methods the budgets part trains (default both, P-EAGLE first)")
    parser.add_argument("--step-seconds", nargs="+", metavar="METHOD=S",
                        help="seconds per step of a method instead of its calibration run (budget -> steps "
                             "independent of the machine's load), e.g. an idle run's: peagle=0.28 eagle3=0.53")
    parser.add_argument("--clock", action="store_true",
                        help="train each run for its budget on the pipeline's own clock (train.recipe.max_train_seconds) "
                             "instead of budget / step time: on a machine of its own, such as a GPU, where a "
                             "short calibration misjudges steady steps; not reproducible step for step, and "
                             "wrong under another job's load")
    args = parser.parse_args()
    try:
        given_step_s = parse_step_seconds(args.step_seconds)
    except ValueError as err:
        parser.error(str(err))
    if args.clock and given_step_s:
        parser.error("--clock trains each budget by the clock; --step-seconds turns budgets into steps: give one")
    if (args.online or args.online_saved) and args.quick:
        parser.error("--online serves the heads in vLLM, which cannot run --quick's tiny target (head_dim 16); "
                     "run --online on a built dataset (the demo's, or --config another)")
    name = result_name(args.config, args.quick)
    if args.render_only:
        render(Run.restore(name))
        return

    from peagle.config import load_config, parse_overrides
    from peagle.layout import RunLayout
    from peagle.paths import peagle_home

    setup_head_bench(args.threads)
    run = Run(name, vars(args))
    base = {**({} if args.quick else MEASURED_K), **parse_overrides(args.set),
            **epochs_override(args.epochs)}
    with tempfile.TemporaryDirectory(prefix="peagle-bench-") as tmp:
        if args.quick:
            data_dir, target_dir = tiny_head_dataset(Path(tmp))
            base, work = {**QUICK_OVERRIDES, **base}, Path(tmp) / "runs"
            if not os.environ.get("MLFLOW_TRACKING_URI"):  # a trial's runs stay out of the user's store
                base["tracking.tracking_uri"] = f"sqlite:///{Path(tmp) / 'mlflow.db'}"
            budgets, ablation_budget, seeds = [3.0], 3.0, args.seeds[:1]
            rows = [0, len(ABLATION) - 1]  # the starting recipe and the whole recipe
            staged_row = 1 + next(i for i, (_, change) in enumerate(VARIANTS) if STAGED in change)
            variant_rows = [0, 1, staged_row]  # the config recipe, the first variant and the staged one
        else:
            from targets import bench_target

            cfg0 = load_config(args.config)
            data_dir = Path(args.data_dir) if args.data_dir else RunLayout(cfg0.run_dir).data.root
            target_dir, work = bench_target(cfg0.target), peagle_home() / "bench" / name
            budgets, ablation_budget, seeds = args.budgets, args.ablation_budget, args.seeds
            rows = args.ablation_rows
            variant_rows = args.variants
        train = load_config(args.config, base).train
        ks = list(range(1, min(train.peagle.k_train, train.eagle3.ttt_steps) + 1))
        bench = Bench(args.config, base, target_info(target_dir, data_dir), data_dir, work, ks, given_step_s, args.clock,
                      name)
        if args.quick:  # one calibration a method: the quick recipes' steps then scale from it, as given ones do
            for method in args.methods:
                bench.given_step_s.setdefault(method, bench.seconds_per_step(method, {})[0])
        results = Results(run, args.quick, {
            "data_dir": str(Path(data_dir).resolve()),
            "data_name": "tiny random target" if args.quick else Path(args.config).stem,
            "ks": ks, "base_overrides": base})
        if args.online_saved:
            results.write(confirm_online(bench, saved_heads(results.saved().get("runs", []), max(budgets), seeds[0])))
            return
        if args.part == "copying":
            for row in reevaluate(bench, results.saved().get("runs", [])):
                results.add(row)
            results.write()
            return
        for seed in seeds:
            if args.part in ("ablation", "all"):
                recipe = dict(OLD_RECIPE)
                for i, (label, change) in enumerate(ABLATION):
                    recipe.update(change)
                    if rows is None or i in rows:
                        results.add(bench.run("ablation", label, "peagle", dict(recipe), ablation_budget, seed))
                if args.ablation_rows is None:
                    results.add(bench.run("ablation", "EAGLE-3 (config)", "eagle3", {}, ablation_budget, seed))
            if args.part in ("variants", "all"):
                for i, (label, change) in enumerate([(RECIPE_LABEL, {}), *VARIANTS]):
                    if variant_rows is None or i in variant_rows:
                        if STAGED in change:
                            results.add(bench.staged("variants", label, change[STAGED], ablation_budget, seed))
                        else:
                            results.add(bench.run("variants", label, "peagle", change, ablation_budget, seed))
            if args.part in ("data", "all"):
                for size in ([4] if args.quick else args.sizes):
                    results.add(bench.run("data", f"first {size} answers", "peagle", {"train.recipe.max_samples": size},
                                          ablation_budget, seed))
            if args.part in ("budgets", "all"):
                for budget in budgets:  # the pair back to back: both see about the same machine load
                    for method in args.methods:
                        results.add(bench.run("budgets", RECIPE_LABEL, method, {}, budget, seed))
        online, online_error = None, None
        if args.online and args.part in ("budgets", "all"):
            try:
                online = confirm_online(bench, results.runs)
            except Exception as err:  # the trained runs are written first, then this is raised
                online_error = err
    results.write(online)
    if online_error is not None:
        raise online_error


if __name__ == "__main__":
    main()
