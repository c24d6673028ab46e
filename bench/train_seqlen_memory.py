"""Peak memory and step time of one P-EAGLE training step against sequence length and S.

Each cell (length L, segments S) runs in a FRESH subprocess doing exactly what the
trainer's micro-batch does (``peagle.train.trainer.run_micro_batch`` without DeepSpeed):
``build_peagle_example`` -> for S > 1 ``segment_batches`` (partition the example, then
collate each segment with the ``PrecomputedMask`` only when it runs) -> ``peagle_loss`` +
``backward`` per segment. Peak memory is the
process's peak RSS (``getrusage`` maxrss) minus its RSS after set-up (drafter, target
head, the sample). A watchdog kills a cell above the memory cap or the time cap; a
length is skipped for an S once a shorter length already hit a cap.

    .venv/bin/python bench/train_seqlen_memory.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_common import Run, bench_spec, run_capped, synthetic_sample  # noqa: E402

K, COD_RATIO, COD_FLOOR, LAYERS, HIDDEN = 8, 0.8, 0.2, 2, 192
MEM_CAP_GIB, TIME_CAP_S = 10.0, 180.0


def maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def run_cell(length: int, segments: int) -> dict:
    """One training step in this (fresh) process; returns its measurements."""
    import torch

    from peagle.methods.peagle.loss import peagle_loss
    from peagle.model.drafter import PEagleDrafter
    from peagle.objective.batch import build_peagle_example, collate
    from peagle.objective.loss import TargetHead
    from peagle.objective.masks import PrecomputedMask
    from peagle.objective.partition import examples_denominator, segment_batches

    torch.set_num_threads(int(os.environ.get("PEAGLE_BENCH_THREADS", "1")))
    torch.manual_seed(0)
    spec = bench_spec(hidden=HIDDEN, layers=LAYERS)
    drafter = PEagleDrafter(spec)
    head = TargetHead(spec.target_hidden_size, spec.draft_vocab_size, spec.rms_norm_eps)
    sample = synthetic_sample(length, spec, seed=0)
    mask = PrecomputedMask(length, K)
    _warm_up(drafter, head, spec)
    base = maxrss_bytes()
    t0 = time.perf_counter()
    example = build_peagle_example(sample, spec, K, COD_RATIO, COD_FLOOR, length, torch.Generator().manual_seed(0))
    denominator = examples_denominator([example], "uniform", K)
    t_data = [time.perf_counter() - t0]

    def collate_fn(examples):  # timed: collation (mask building) is data time, wherever it runs
        start = time.perf_counter()
        batch = collate(examples, mask)
        t_data[0] += time.perf_counter() - start
        return batch

    parts = segment_batches([example], segments, collate_fn) if segments > 1 else iter([collate_fn([example])])
    largest = 0
    for part in parts:
        largest = max(largest, part.input_ids.shape[1])
        out = peagle_loss(drafter, head, part, "uniform", denominator, k=K)
        out.loss.backward()
        del out, part
    step = time.perf_counter() - t0
    return {
        "elements": len(example),
        "largest_segment": largest,
        "peak_gib": (maxrss_bytes() - base) / 2**30,
        "step_s": step,
        "data_s": t_data[0],
    }


def _warm_up(drafter, head, spec) -> None:
    """One tiny step first, so the measured step pays no one-off kernel/allocator set-up."""
    import torch

    from peagle.methods.peagle.loss import peagle_loss
    from peagle.objective.batch import build_peagle_example, collate
    from peagle.objective.masks import PrecomputedMask

    sample = synthetic_sample(64, spec, seed=1)
    example = build_peagle_example(sample, spec, K, COD_RATIO, COD_FLOOR, 64, torch.Generator().manual_seed(1))
    peagle_loss(drafter, head, collate([example], PrecomputedMask(64, K)), "uniform", k=K).loss.backward()
    drafter.zero_grad(set_to_none=True)


def measure(length: int, segments: int, mem_cap: float, time_cap: float, threads: int) -> dict:
    """Run one cell in a fresh interpreter under the memory and time caps."""
    return run_capped([sys.executable, __file__, "--cell", str(length), str(segments)], threads, mem_cap, time_cap,
                      0.1, over_memory="OOM (>{cap:g} GiB)", over_time="skipped (>{cap:g} s; RSS {rss:.2f} GiB when stopped)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny grid (smoke test)")
    parser.add_argument("--cell", nargs=2, type=int, metavar=("LENGTH", "SEGMENTS"), help=argparse.SUPPRESS)
    parser.add_argument("--budget-s", type=float, default=480.0, help="skip the remaining cells after this long")
    parser.add_argument("--lengths", type=int, nargs="*")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per cell (1: no OpenMP contention)")
    parser.add_argument("--segments", type=int, nargs="*", help="segment counts (default 1 2 4 8)")
    parser.add_argument("--time-cap-s", type=float, default=TIME_CAP_S, help="per-cell time cap")
    parser.add_argument("--mem-cap-gib", type=float, default=MEM_CAP_GIB, help="per-cell RSS cap")
    parser.add_argument("--name", default="train_seqlen_memory", help="result file name (bench/results/<name>.json)")
    args = parser.parse_args()
    if args.cell:
        print(json.dumps(run_cell(*args.cell)))
        return
    import torch

    torch.set_num_threads(args.threads)  # so the recorded thread count is the cells'
    lengths = args.lengths or ([256, 512] if args.quick else [2048, 4096, 8192, 16384])
    seg_counts = args.segments or ([1, 2] if args.quick else [1, 2, 4, 8])
    mem_cap, time_cap = args.mem_cap_gib, args.time_cap_s
    run = Run(args.name, {"lengths": lengths, "segments": seg_counts, "K": K, "cod_ratio": COD_RATIO,
                                      "cod_floor": COD_FLOOR, "H": HIDDEN, "layers": LAYERS, "mem_cap_gib": mem_cap,
                                      "time_cap_s": time_cap, "budget_s": args.budget_s, "quick": args.quick,
                                      "cell_torch_threads": args.threads})
    results: dict[tuple[int, int], dict] = {}
    capped: set[int] = set()
    t_start = time.monotonic()
    for length in lengths:
        for s in seg_counts:
            if s in capped:
                results[length, s] = {"status": "skipped (shorter length hit a cap)"}
            elif time.monotonic() - t_start > args.budget_s:
                results[length, s] = {"status": "skipped (run budget)"}
            else:
                results[length, s] = measure(length, s, mem_cap, time_cap, args.threads)
                if results[length, s]["status"] != "ok":
                    capped.add(s)
            r = results[length, s]
            print(f"L={length} S={s}: {r}", flush=True)
    rows = []
    for length in lengths:
        ref = results.get((length, 1), {"status": "not run"})
        for s in seg_counts:
            r = results[length, s]
            if r["status"] != "ok":
                rows.append([length, s, "-", "-", r["status"], "-", "-", "-"])
                continue
            ok_ref = ref["status"] == "ok"
            mem_ratio = r["peak_gib"] / ref["peak_gib"] if ok_ref else "-"
            time_ratio = r["step_s"] / ref["step_s"] if ok_ref else "-"
            rows.append([length, s, r["elements"], r["largest_segment"], round(r["peak_gib"], 3), mem_ratio,
                         round(r["step_s"], 2), time_ratio])
    run.add_table(
        "P-EAGLE train step (fwd+bwd, batch 1) vs sequence length and segments S",
        ["L", "S", "elements N", "largest segment", "peak RSS increase GiB", "mem / S=1", "step s", "time / S=1"],
        rows,
    )
    run.finish([
        f"CPU, fp32, drafter H={HIDDEN} x {LAYERS} layers, K={K}, COD ratio {COD_RATIO} floor {COD_FLOOR}, "
        "synthetic 2048-vocab draft head, 10% prompt / 90% response",
        "path = the trainer's: build_peagle_example -> segment_batches (partition the example, collate each segment "
        "when it runs; S=1: collate the whole example) -> peagle_loss+backward per segment",
        "each cell is a fresh subprocess; peak = getrusage maxrss minus RSS after set-up",
    ])


if __name__ == "__main__":
    main()
