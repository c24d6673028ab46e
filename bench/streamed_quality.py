"""What streaming buys in quality: a head trained on thousands of answers within one time budget.

The peers' small-data reference is 5,000 samples: speculators' nightly checks require P-EAGLE
per-position acceptance of at least 0.45 / 0.10 / 0.01 after 5 epochs on 5K samples (Qwen3-8B).
This bench runs the demo's recipe (half code requests, half requests the target writes itself
through Magpie) at ``--answers`` training answers, with hidden states streamed through a spool
of ``--spool-gib``, the whole of it data included inside ``--hours``:

1. ``peagle data`` (Magpie requests, regeneration by the target, the held-out and served splits'
   hidden states; the train split keeps only tokens), timed;
2. ``peagle train`` for the time left (``train.recipe.max_train_seconds``: the budget less the data
   stage, ``--eval-reserve-s`` for steps 3-4 and ``--train-overhead-s`` for what the training
   clock does not count: engine and rank start-up, checkpoints, the offline evaluations every
   ``--eval-every`` steps), as many epochs as fit, extraction running beside the ranks;
3. ``peagle export`` and ``peagle evaluate``: the head in vLLM on HumanEval and chat, beside no
   speculation and n-gram lookup at the same K.

Reported: per prompt set, the head's per-position acceptance against the bounds, its tokens per
target step against n-gram lookup's, tokens/s; the offline acceptance length against answers
seen (``metrics.jsonl``: each step's samples, each evaluation's acceptance), plotted; and each
step's wall time. Results: ``results/streamed_quality.{md,json,png}``.

    .venv/bin/python bench/streamed_quality.py [--answers 5000] [--hours 2.5]
    .venv/bin/python bench/streamed_quality.py --render-only
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_common import render_saved, report, started  # noqa: E402
from result_files import result_path  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
NAME = "streamed_quality"
# speculators' nightly P-EAGLE check after 5 epochs on 5K samples: acceptance at draft positions 1, 2, 3
BOUNDS = (0.45, 0.10, 0.01)
HEAD = "p-eagle"


def peagle(*args: str) -> float:
    """Run ``peagle ARGS`` (its output to the console); its wall seconds. A failure stops the bench."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "peagle.cli", *map(str, args)], cwd=REPO, check=True)
    return round(time.perf_counter() - start, 1)


def bench_config(args) -> Path:
    """The demo's config grown to ``--answers`` training answers, streamed, the head alone."""
    cfg = yaml.safe_load(args.config.read_text())
    code_prompts = sum(1 for line in (REPO / "data/prompts/code_train.jsonl").open() if line.strip())
    total = args.answers + cfg["data"]["heldout_samples"]
    magpie = total - min(code_prompts, total // 2) + args.magpie_spare  # a few are dropped as duplicates or short
    cfg["name"] = f"demo-{args.answers}"
    cfg["workdir"] = str(args.workdir / "run")
    for source in cfg["data"]["sources"]:
        if source["kind"] == "magpie":
            source["path"] = str(args.workdir / "magpie.jsonl")
            source["max_samples"] = magpie
    cfg["data"] |= {"max_samples": total, "hidden_states": "streamed", "spool_gib": args.spool_gib}
    train = cfg["train"]
    train["baseline"] = {**train.get("baseline", {}), "eagle3": False}
    train["recipe"] = {**train.get("recipe", {}), "epochs": args.epochs}
    train["checkpoints"] = {**train.get("checkpoints", {}), "eval_every": args.eval_every, "save_every": args.eval_every}
    cfg["eval"] |= {"num_prompts": args.num_prompts}
    cfg["tracking"] = {**cfg.get("tracking", {}), "registered_model": f"peagle-bench-{NAME}"}
    path = args.workdir / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def learning_curve(metrics: Path) -> list[dict]:
    """(answers seen, offline acceptance length) at each evaluation of the run, in step order."""
    seen, curve = 0, []
    for record in map(json.loads, filter(str.strip, metrics.read_text().splitlines())):
        seen += len(record.get("samples", []))
        if "eval/acceptance" in record:
            curve.append({"step": record["step"], "answers_seen": seen, "acceptance": record["eval/acceptance"]})
    return curve


def training_numbers(metrics: Path) -> dict:
    records = [r for r in map(json.loads, filter(str.strip, metrics.read_text().splitlines())) if "step_time_s" in r]
    return {"steps": records[-1]["step"] if records else 0, "answers_seen": sum(len(r.get("samples", [])) for r in records),
            "step_seconds": round(sum(r["step_time_s"] for r in records), 1),
            "tokens_per_s": round(sum(r["tokens"] for r in records) / max(sum(r["step_time_s"] for r in records), 1e-9), 1)}


def online_rows(results: Path) -> list[dict]:
    """Per prompt set: the head's row and n-gram lookup's at the same K, one request at a time."""
    from peagle.eval.online import OnlineResult

    rows = []
    for result in OnlineResult.load(results).prompt_sets():
        base = result.baseline(1)
        for head in (r for r in result.rows if r.method == HEAD and r.concurrency == 1):
            ngram = result.ngram(head.k, 1)
            rows.append({
                "prompt_set": result.prompt_set, "k": head.k, "requests": head.requests,
                "output_tokens": head.output_tokens, "per_position": head.per_position_acceptance,
                "acceptance_length": head.acceptance_length, "tokens_per_step": head.tokens_per_step,
                "ngram_tokens_per_step": ngram.tokens_per_step if ngram else None,
                "ngram_min_tokens_per_step": ngram.min_tokens_per_step if ngram else None,
                "tokens_per_s": head.output_tokens_per_s,
                "ngram_tokens_per_s": ngram.output_tokens_per_s if ngram else None,
                "baseline_tokens_per_s": base.output_tokens_per_s if base else None,
            })
    return rows


def plot(result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = result["curve"]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    ax.plot([p["answers_seen"] for p in curve], [p["acceptance"] for p in curve], marker="o", label=HEAD)
    ax.axvline(result["answers"], color="grey", linestyle=":", label="one epoch")
    ax.set_xlabel("answers seen")
    ax.set_ylabel(f"offline acceptance length, K={result['k']}")
    ax.set_title(f"{result['answers']} answers streamed, {result['hours']} h on 2 cores, data included")
    ax.legend()
    fig.tight_layout()
    fig.savefig(result_path(NAME, ".png"), dpi=120)
    plt.close(fig)


def tables(result: dict):
    def num(x, fmt=".2f"):
        return "-" if x is None else format(x, fmt)

    online = []
    for r in result["online"]:
        meets = all(a >= b for a, b in zip(r["per_position"], BOUNDS, strict=False))
        ngram = (num(r["ngram_tokens_per_step"]) if num(r["ngram_min_tokens_per_step"]) == num(r["ngram_tokens_per_step"])
                 else f"{num(r['ngram_min_tokens_per_step'])}-{num(r['ngram_tokens_per_step'])}")
        online.append([r["prompt_set"], str(r["k"]), " ".join(f"{a:.2f}" for a in r["per_position"]),
                       "yes" if meets else "no", num(r["tokens_per_step"]), ngram,
                       "yes" if r["ngram_tokens_per_step"] is not None and r["tokens_per_step"] > r["ngram_tokens_per_step"]
                       else "no",
                       *(num(r[key], ".1f") for key in ("tokens_per_s", "ngram_tokens_per_s", "baseline_tokens_per_s"))])
    t = result["training"]
    stages = [[name, f"{seconds:.0f}", f"{seconds / 60:.1f}"] for name, seconds in result["seconds"].items()]
    stages.append(["total", f"{sum(result['seconds'].values()):.0f}", f"{sum(result['seconds'].values()) / 60:.1f}"])
    curve = [[str(p["step"]), str(p["answers_seen"]), f"{p['answers_seen'] / result['answers']:.2f}",
              f"{p['acceptance']:.3f}"] for p in result["curve"]]
    return [
        (f"The head in vLLM, one request at a time ({' / '.join(map(str, BOUNDS))}: the per-position bounds)",
         ["prompt set", "K", "per position", "meets bounds", "tokens/step", "n-gram tokens/step", "above n-gram",
          "tok/s", "n-gram tok/s", "no spec. tok/s"], online),
        (f"Training: {t['steps']} steps, {t['answers_seen']} answers seen ({t['answers_seen'] / result['answers']:.2f} "
         f"epochs), {t['tokens_per_s']:.0f} tokens/s over {t['step_seconds']:.0f} s of steps",
         ["step", "answers seen", "epochs", "offline acceptance length"], curve),
        ("Wall time", ["stage", "s", "min"], stages),
    ]


def notes(result: dict) -> list[str]:
    return [
        f"config: {result['config_source']} grown to {result['answers']} training answers (half code requests, "
        f"half Magpie requests the target writes), data.hidden_states streamed through a {result['spool_gib']} GiB "
        f"spool, train.recipe.max_train_seconds {result['train_budget_s']:.0f} (the {result['hours']} h less the data stage "
        f"and {result['eval_reserve_s']:.0f} s for export and evaluation, {result['train_overhead_s']:.0f} s for start-up "
        "and evaluations)",
        "per position: vLLM's acceptance rate at draft positions 1..K on the prompt set; the bounds are speculators' "
        "nightly P-EAGLE check (Qwen3-8B, 5 epochs on 5K samples); tokens/step: output tokens per target forward pass "
        "(n-gram lookup's is a range: vLLM counts drafts accepted past a request's end)",
        "offline acceptance length: the trainer's checkpoint evaluation on the served split (the eval prompts with "
        "the target's greedy answers, walked as vLLM decodes) at the largest K",
        "2 shared cores: the extraction engine and the rank take turns on them while training",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "demo.yaml")
    parser.add_argument("--answers", type=int, default=5000)
    parser.add_argument("--magpie-spare", type=int, default=100, help="extra Magpie requests for those dropped")
    parser.add_argument("--hours", type=float, default=2.5)
    parser.add_argument("--eval-reserve-s", type=float, default=900)
    parser.add_argument("--train-overhead-s", type=float, default=600)
    parser.add_argument("--spool-gib", type=float, default=1.0)
    parser.add_argument("--epochs", type=int, default=5, help="the most epochs; the time budget ends the run first")
    parser.add_argument("--eval-every", type=int, default=500)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--workdir", type=Path, default=REPO / ".peagle" / "bench" / NAME)
    parser.add_argument("--render-only", action="store_true")
    args = parser.parse_args()
    if args.render_only:
        render_saved(NAME, tables, notes)
        return
    progress = args.workdir / "progress.json"  # a stopped bench reruns only the steps it did not finish
    result = json.loads(progress.read_text()) if progress.exists() else {
        **started(), "config_source": str(args.config.relative_to(REPO)), "answers": args.answers, "hours": args.hours,
        "spool_gib": args.spool_gib, "eval_reserve_s": args.eval_reserve_s, "train_overhead_s": args.train_overhead_s,
        "seconds": {}}
    config = bench_config(args)

    def step(name: str, *command: str) -> None:
        if name not in result["seconds"]:
            result["seconds"][name] = peagle(*command)
            progress.write_text(json.dumps(result, indent=2))

    step("data", "data", config)
    budget = args.hours * 3600 - result["seconds"]["data"] - args.eval_reserve_s - args.train_overhead_s
    if budget < 600:
        raise SystemExit(f"the data stage took {result['seconds']['data']:.0f} s: {budget:.0f} s are left to train")
    result["train_budget_s"] = budget
    budget_set = ("--set", f"train.recipe.max_train_seconds={budget:.0f}")  # part of the head's identity: every step names it
    step("train", "train", config, *budget_set)
    step("export", "export", config, *budget_set)
    step("evaluate", "evaluate", config, *budget_set)
    run = args.workdir / "run"
    [metrics] = (run / "checkpoints").glob("peagle/*/metrics.jsonl")
    result["training"] = training_numbers(metrics)
    result["curve"] = learning_curve(metrics)
    result["online"] = online_rows(run / "eval" / "online_results.json")
    result["k"] = max(r["k"] for r in result["online"])
    report(NAME, result, tables(result), notes(result))
    plot(result)


if __name__ == "__main__":
    main()
