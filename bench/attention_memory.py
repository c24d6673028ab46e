"""Time and peak memory of the drafter's attention per step, dense mask against flex attention's block mask.

The drafter evaluates P-EAGLE's attention rule either as a dense [B, N, N] mask with SDPA
(``train.launch.attention: dense``) or as flex attention's block-sparse mask built from the
elements' anchor, depth and document (``flex``; ``peagle.objective.masks.ElementAttention``).
Each cell is one step at a scaled shape (H=256, 4 query heads sharing 1 KV head, K_train 8,
COD 0.8, batch 1) in a FRESH subprocess, through ``peagle_loss`` as the trainer and offline
evaluation call it: the batch's rule, evaluated by the backend, the drafter, lm_head on the
supervised elements, the KL. Peak memory is the step's own: the most RSS seen during it
(sampled, and getrusage's maximum where the step set a new one) minus the RSS before it.

On CPU torch 2.13's flex attention runs forward only (no backward), so the dense/flex
comparison is the forward step (offline evaluation, drafting), taken in rounds that
alternate the two backends (ratios within a round); the dense forward+backward (CPU
training) is measured beside it. Flex's first calls in a process compile its kernel
(two warm-up steps of other element counts: the static, then the dynamic kernel); the
measured step reuses it. A dense cell whose quadratic extrapolation from the previous
length exceeds the memory cap is skipped and says what it would need; a watchdog stops a
cell at the cap.

    .venv/bin/python bench/attention_memory.py [--quick]
    .venv/bin/python bench/attention_memory.py --render-only   # re-print results/attention_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_common import Run, bench_spec, run_capped, synthetic_sample  # noqa: E402

K, COD_RATIO, COD_FLOOR, HIDDEN, LAYERS, DRAFT_VOCAB = 8, 0.8, 0.2, 256, 1, 256  # a small Vd: its logits would hide attention
MEM_CAP_GIB, TIME_CAP_S, BUDGET_S = 6.0, 300.0, 840.0
NAME = "attention_memory"
# Two warm-up examples of different element and tile counts (above one 128-element tile): flex
# compiles its static kernel, then the dynamic one that every later size reuses.
WARM_UP_TOKENS = (48, 112)
CELLS = {  # name -> (backend, with backward)
    "dense fwd": ("dense", False),
    "flex fwd": ("flex", False),
    "dense fwd+bwd": ("dense", True),
}


# ----------------------------------------------------------------------------- one cell (a fresh process)


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


class StepPeak:
    """The most RSS a block of code adds: a sampling thread, and getrusage where it set a new maximum."""

    def __enter__(self):
        self.before, self.max_before, self.peak = rss_bytes(), maxrss_bytes(), 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._done.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
        after_max = maxrss_bytes()
        peak = max(self.peak, rss_bytes(), after_max if after_max > self.max_before else 0)
        self.gib = (peak - self.before) / 2**30


def make_step(length: int, backend: str, backward: bool, seed: int = 0):
    """(drafter, a callable running one step of an ``length``-token example, the example's size)."""
    import torch

    from peagle.methods.peagle.loss import peagle_loss
    from peagle.model.drafter import PEagleDrafter
    from peagle.objective.batch import build_peagle_example, collate
    from peagle.objective.loss import TargetHead
    from peagle.objective.masks import PrecomputedMask

    torch.manual_seed(0)
    spec = bench_spec(hidden=HIDDEN, layers=LAYERS, draft_vocab=DRAFT_VOCAB)
    drafter = PEagleDrafter(spec)
    drafter.attention = backend
    head = TargetHead(spec.target_hidden_size, spec.draft_vocab_size, spec.rms_norm_eps)
    example = build_peagle_example(synthetic_sample(length, spec, seed=seed), spec, K, COD_RATIO, COD_FLOOR, length,
                                   torch.Generator().manual_seed(seed))
    batch = collate([example], PrecomputedMask(length, K))

    def step():
        if backward:
            peagle_loss(drafter, head, batch, k=K).loss.backward()
            drafter.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                peagle_loss(drafter, head, batch, k=K)

    return step, len(example)


def run_cell(length: int, cell: str) -> dict:
    """One step of ``cell`` at ``length`` tokens in this (fresh) process; its measurements."""
    import torch

    torch.set_num_threads(int(os.environ.get("PEAGLE_BENCH_THREADS", "1")))
    backend, backward = CELLS[cell]
    start = time.perf_counter()
    for tokens in WARM_UP_TOKENS:  # flex: compiles here; dense: first-call set-up
        make_step(tokens, backend, backward, seed=1)[0]()
    warm_up = time.perf_counter() - start
    step, elements = make_step(length, backend, backward)
    with StepPeak() as peak:
        start = time.perf_counter()
        step()
        seconds = time.perf_counter() - start
    return {"elements": elements, "step_s": seconds, "peak_gib": peak.gib, "warm_up_s": warm_up}


def mask_sizes(length: int) -> dict:
    """The rule's two forms for one example (no drafter): bytes and build time of each."""
    import torch

    from peagle.objective.batch import build_peagle_example, collate
    from peagle.objective.masks import PrecomputedMask

    torch.set_num_threads(int(os.environ.get("PEAGLE_BENCH_THREADS", "1")))
    spec = bench_spec(hidden=HIDDEN, layers=LAYERS, draft_vocab=DRAFT_VOCAB)
    example = build_peagle_example(synthetic_sample(length, spec, seed=0), spec, K, COD_RATIO, COD_FLOOR, length,
                                   torch.Generator().manual_seed(0))
    rule = collate([example], PrecomputedMask(length, K)).attention
    start = time.perf_counter()
    block = rule.block_mask()
    block_s = time.perf_counter() - start
    tiles = block.kv_indices.shape[-1]
    visited = int(block.kv_num_blocks.sum() + block.full_kv_num_blocks.sum())
    block_bytes = sum(t.numel() * t.element_size() for t in block.as_tuple() if isinstance(t, torch.Tensor))
    return {"elements": len(example), "tiles": tiles, "visited": visited / tiles**2,
            "full": int(block.full_kv_num_blocks.sum()) / tiles**2, "block_mask_s": block_s,
            "block_mask_mib": block_bytes / 2**20, "dense_mask_gib": len(example) ** 2 / 2**30}


# ----------------------------------------------------------------------------- the grid (this process)


def in_subprocess(args: list[str], mem_cap: float, time_cap: float, threads: int) -> dict:
    """Run ``--cell``/``--masks`` in a fresh interpreter, stopped at the memory or time cap."""
    return run_capped([sys.executable, __file__, *args], threads, mem_cap, time_cap, 0.05,
                      over_memory="stopped at the {cap:g} GiB cap",
                      over_time="stopped at the {cap:g} s cap (RSS {rss:.2f} GiB)")


class Grid:
    """Every (length, cell, round) measured so far, and what the next dense cell would need."""

    def __init__(self, mem_cap: float, time_cap: float, threads: int, budget_s: float):
        self.mem_cap, self.time_cap, self.threads, self.budget_s = mem_cap, time_cap, threads, budget_s
        self.started = time.monotonic()
        self.runs: dict[tuple[int, str], list[dict]] = {}
        self.last_ok: dict[str, tuple[int, dict]] = {}  # cell -> (elements, its measurement) at the longest length

    def measure(self, length: int, elements: int, cell: str) -> dict:
        skip = self._skip_reason(elements, cell)
        result = {"status": skip} if skip else in_subprocess(["--cell", str(length), cell], self.mem_cap,
                                                              self.time_cap, self.threads)
        self.runs.setdefault((length, cell), []).append(result)
        if result["status"] == "ok":
            self.last_ok[cell] = (elements, result)
        print(f"L={length} {cell}: {result}", flush=True)
        return result

    def _skip_reason(self, elements: int, cell: str) -> str | None:
        if time.monotonic() - self.started > self.budget_s:
            return "skipped (run budget)"
        if cell.startswith("dense") and cell in self.last_ok:
            known_elements, known = self.last_ok[cell]
            need = known["peak_gib"] * (elements / known_elements) ** 2
            if need > self.mem_cap:
                return f"skipped: would need ~{need:.1f} GiB"
        return None


def median(results: list[dict], key: str) -> float | None:
    values = [r[key] for r in results if r["status"] == "ok"]
    return statistics.median(values) if values else None


def cell_text(results: list[dict], key: str, digits: int = 3):
    value = median(results, key)
    if value is not None:
        return round(value, digits)
    return results[-1]["status"] if results else "not run"


def warm_up(results: list[dict]) -> float | str:
    value = median(results, "warm_up_s")
    return "-" if value is None else round(value, 1)


def round_ratios(cells: dict, length: int, key: str) -> float | str:
    """Median over rounds of flex / dense forward, each ratio taken within one round."""
    pairs = zip(cells.get(f"{length} dense fwd", []), cells.get(f"{length} flex fwd", []), strict=False)
    ratios = [f[key] / d[key] for d, f in pairs if d["status"] == f["status"] == "ok" and d[key] > 0]
    return round(statistics.median(ratios), 3) if ratios else "-"


def render(run: Run) -> None:
    """The tables from the run's saved cells (``meta["cells"]``, ``meta["masks"]``)."""
    cells, masks = run.meta["cells"], run.meta["masks"]
    lengths = [int(length) for length in masks]

    def runs(length, cell):
        return cells.get(f"{length} {cell}", [])

    run.add_table(
        "Forward step (no grad: offline evaluation, drafting) and the CPU training step, per example",
        ["tokens", "elements N", "dense fwd s", "dense fwd GiB", "flex fwd s", "flex fwd GiB", "flex/dense time",
         "flex/dense memory", "dense fwd+bwd s", "dense fwd+bwd GiB", "rounds"],
        [[length, masks[str(length)].get("elements", "-"),
          cell_text(runs(length, "dense fwd"), "step_s"), cell_text(runs(length, "dense fwd"), "peak_gib"),
          cell_text(runs(length, "flex fwd"), "step_s"), cell_text(runs(length, "flex fwd"), "peak_gib"),
          round_ratios(cells, length, "step_s"), round_ratios(cells, length, "peak_gib"),
          cell_text(runs(length, "dense fwd+bwd"), "step_s"), cell_text(runs(length, "dense fwd+bwd"), "peak_gib"),
          len(runs(length, "flex fwd"))] for length in lengths],
        note="flex fwd+bwd is not on this table: torch 2.13 has no flex-attention backward on CPU (the trainer's "
             "train.launch.attention: auto takes flex on CUDA and dense here).",
    )
    run.add_table(
        "The rule's two forms for one example, and what a fresh process pays before its first step",
        ["tokens", "elements N", "dense mask GiB", "block mask MiB", "block mask build s", "tiles visited",
         "of them full", "dense warm-up s", "flex warm-up s"],
        [[length, m.get("elements", "-"), round(m["dense_mask_gib"], 3) if "dense_mask_gib" in m else m["status"],
          round(m["block_mask_mib"], 3) if "block_mask_mib" in m else "-",
          round(m["block_mask_s"], 3) if "block_mask_s" in m else "-",
          f"{m['visited']:.1%}" if "visited" in m else "-", f"{m['full']:.1%}" if "full" in m else "-",
          warm_up(runs(length, "dense fwd")), warm_up(runs(length, "flex fwd"))]
         for length, m in ((int(k), v) for k, v in masks.items())],
        note="warm-up = two small steps in the cell's fresh process before the measured one: the drafter's first "
             "calls, and for flex its compilation (the static kernel, then the dynamic one the measured step reuses; "
             "torch's compile cache on disk was warm).",
    )
    a = run.args
    run.finish([
        f"CPU, fp32, drafter H={a['H']} x {a['layers']} layer (4 query heads, 1 KV head, 64 wide), K={a['K']}, COD "
        f"ratio {a['cod_ratio']} floor {a['cod_floor']}, synthetic {a['draft_vocab']}-token draft head, 10% prompt / "
        "90% response",
        "a step = peagle_loss (the rule evaluated by the backend, the drafter, lm_head on the supervised elements, "
        "KL), under no_grad for the forward cells and with backward for the training one",
        "each cell is a fresh subprocess after its warm-up; GiB = the step's peak RSS minus the RSS before it; "
        "times and GiB are medians over rounds; ratios are taken within a round; a dense cell is skipped when its "
        f"previous length's peak, scaled by N^2, exceeds the {a['mem_cap_gib']:g} GiB cap",
        "dense mask GiB = N^2 bools, the [N, N] mask alone (SDPA's working set comes on top); block mask MiB = "
        "every tensor of flex attention's BlockMask (an int32 per 128 x 128 tile and direction: 1/1024 of the "
        "dense mask's bytes)",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny lengths, one round (smoke test)")
    parser.add_argument("--render-only", action="store_true", help="re-print results/attention_memory.json")
    parser.add_argument("--cell", nargs=2, metavar=("LENGTH", "CELL"), help=argparse.SUPPRESS)
    parser.add_argument("--masks", type=int, metavar="LENGTH", help=argparse.SUPPRESS)
    parser.add_argument("--lengths", type=int, nargs="*", help="tokens per example (default 2048 ... 32768)")
    parser.add_argument("--rounds", type=int, default=2, help="dense/flex forward rounds up to --rounds-until tokens")
    parser.add_argument("--rounds-until", type=int, default=4096, help="longer lengths run one round")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per cell")
    parser.add_argument("--mem-cap-gib", type=float, default=MEM_CAP_GIB, help="per-cell RSS cap")
    parser.add_argument("--time-cap-s", type=float, default=TIME_CAP_S, help="per-cell time cap")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="skip the remaining cells after this long")
    args = parser.parse_args()
    if args.cell:
        print(json.dumps(run_cell(int(args.cell[0]), args.cell[1])))
        return
    if args.masks:
        print(json.dumps(mask_sizes(args.masks)))
        return
    if args.render_only:
        render(Run.restore(NAME))
        return
    import torch

    torch.set_num_threads(args.threads)  # so the recorded thread count is the cells'
    lengths = args.lengths or ([256, 512] if args.quick else [2048, 4096, 8192, 16384, 32768])
    rounds = 1 if args.quick else args.rounds
    run = Run(NAME, {"lengths": lengths, "rounds": rounds, "rounds_until": args.rounds_until, "K": K,
                     "cod_ratio": COD_RATIO, "cod_floor": COD_FLOOR, "H": HIDDEN, "layers": LAYERS,
                     "draft_vocab": DRAFT_VOCAB, "mem_cap_gib": args.mem_cap_gib, "time_cap_s": args.time_cap_s,
                     "budget_s": args.budget_s, "quick": args.quick, "cell_torch_threads": args.threads})
    grid = Grid(args.mem_cap_gib, args.time_cap_s, args.threads, args.budget_s)
    masks = {}
    for length in lengths:
        masks[str(length)] = in_subprocess(["--masks", str(length)], args.mem_cap_gib, args.time_cap_s, args.threads)
        print(f"L={length} masks: {masks[str(length)]}", flush=True)
        elements = masks[str(length)].get("elements", 0)
        for _ in range(rounds if length <= args.rounds_until else 1):
            for cell in ("dense fwd", "flex fwd"):
                grid.measure(length, elements, cell)
        grid.measure(length, elements, "dense fwd+bwd")
    run.meta["masks"] = masks
    run.meta["cells"] = {f"{length} {cell}": results for (length, cell), results in grid.runs.items()}
    render(run)


if __name__ == "__main__":
    main()
