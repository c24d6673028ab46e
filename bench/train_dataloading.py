"""Data-loading time per epoch: precomputed P-EAGLE masks vs per-pair masks vs EAGLE-3 batches.

Every variant turns the same samples (length 2048, K = 8) into training batches of one
example, the trainer's micro-batch, and is timed over the whole set (one epoch):

- P-EAGLE, precomputed mask: ``build_peagle_example`` + ``collate`` with ``PrecomputedMask``
  (what the trainer does);
- P-EAGLE, per-pair mask: the same examples, the mask evaluated pair by pair per example
  (``brute_force_mask``; PARD-style per-example construction);
- EAGLE-3 (this repo): ``build_eagle3_example`` (all anchors x ttt steps, ground-truth
  tokens) + ``collate`` - what ``peagle.methods.eagle3``'s objective loads per example;
- EAGLE-3 (classic loader): tokens, hidden states and one causal [L, L] mask, what an
  EAGLE-3 trainer that builds its TTT steps inside the model needs.

Paper anchor (per epoch, their data set and hardware): P-EAGLE 17.5 s, EAGLE-3 14.8 s,
PARD 718.5 s.

    .venv/bin/python bench/train_dataloading.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from peagle.train.batch import build_peagle_example, collate  # noqa: E402
from peagle.methods.eagle3 import build_eagle3_example  # noqa: E402
from peagle.train.masks import PrecomputedMask, brute_force_mask  # noqa: E402
from train_common import Run, bench_spec, synthetic_sample  # noqa: E402

K, COD_RATIO, COD_FLOOR, TTT_STEPS = 8, 0.8, 0.2, 8


class PerPairMask:
    """``collate``'s mask source that evaluates the attention rule for every pair."""

    def mask_for(self, anchor, depth, doc=None, out=None):
        mask = brute_force_mask(anchor, depth, doc)
        return mask if out is None else out.copy_(mask)


def peagle_precomputed(samples, spec, max_len):
    mask = PrecomputedMask(max_len, K)
    for i, s in enumerate(samples):
        ex = build_peagle_example(s, spec, K, COD_RATIO, COD_FLOOR, max_len, torch.Generator().manual_seed(i))
        yield collate([ex], mask)


def peagle_per_pair(samples, spec, max_len):
    mask = PerPairMask()
    for i, s in enumerate(samples):
        ex = build_peagle_example(s, spec, K, COD_RATIO, COD_FLOOR, max_len, torch.Generator().manual_seed(i))
        yield collate([ex], mask)


def eagle3_repo(samples, spec, max_len):
    mask = PrecomputedMask(max_len, TTT_STEPS)
    for s in samples:
        yield collate([build_eagle3_example(s, spec, TTT_STEPS, max_len)], mask)


def eagle3_classic(samples, spec, max_len):
    for s in samples:
        n = min(s.token_ids.numel(), max_len)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        yield (s.token_ids[:n].long(), s.loss_mask[:n], s.hidden[:n].float(), causal)


VARIANTS = {
    "P-EAGLE, precomputed mask (trainer)": peagle_precomputed,
    "P-EAGLE, per-pair mask (brute force)": peagle_per_pair,
    "EAGLE-3, this repo's objective": eagle3_repo,
    "EAGLE-3, classic loader (causal mask)": eagle3_classic,
}


def time_epochs(samples, spec, max_len, repeats: int) -> dict[str, tuple[float, int]]:
    """Per variant: seconds to build every batch of one epoch (best of ``repeats``), elements.

    The variants take turns sample by sample, so on a shared machine they see the same load.
    """
    best: dict[str, float] = {}
    elements: dict[str, int] = {}
    for _ in range(repeats):
        seconds = dict.fromkeys(VARIANTS, 0.0)
        elements = dict.fromkeys(VARIANTS, 0)
        for sample in samples:
            for name, variant in VARIANTS.items():
                start = time.perf_counter()
                batch = next(variant([sample], spec, max_len))
                seconds[name] += time.perf_counter() - start
                elements[name] += batch[0].numel() if isinstance(batch, tuple) else batch.input_ids.numel()
        best = {name: min(best.get(name, float("inf")), s) for name, s in seconds.items()}
    return {name: (best[name], elements[name]) for name in VARIANTS}


def time_masks(samples, spec, max_len) -> dict[str, float]:
    """Seconds over the epoch for the attention mask alone (examples built untimed beforehand)."""
    pre, pre3 = PrecomputedMask(max_len, K), PrecomputedMask(max_len, TTT_STEPS)
    seconds = dict.fromkeys(MASK_VARIANTS, 0.0)
    for i, sample in enumerate(samples):
        ex = build_peagle_example(sample, spec, K, COD_RATIO, COD_FLOOR, max_len, torch.Generator().manual_seed(i))
        ex3 = build_eagle3_example(sample, spec, TTT_STEPS, max_len)
        n = min(sample.token_ids.numel(), max_len)
        jobs = {
            "P-EAGLE, PrecomputedMask.mask_for": lambda: pre.mask_for(ex.anchor, ex.depth, ex.doc),
            "P-EAGLE, brute_force_mask (per pair)": lambda: brute_force_mask(ex.anchor, ex.depth, ex.doc),
            "EAGLE-3 (this repo), PrecomputedMask.mask_for": lambda: pre3.mask_for(ex3.anchor, ex3.depth, ex3.doc),
            "EAGLE-3 classic, causal tril": lambda: torch.ones(n, n, dtype=torch.bool).tril(),
        }
        for name, job in jobs.items():
            start = time.perf_counter()
            job()
            seconds[name] += time.perf_counter() - start
    return seconds


MASK_VARIANTS = [
    "P-EAGLE, PrecomputedMask.mask_for",
    "P-EAGLE, brute_force_mask (per pair)",
    "EAGLE-3 (this repo), PrecomputedMask.mask_for",
    "EAGLE-3 classic, causal tril",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few short samples (smoke test)")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=1, help="epochs per variant; the fastest is kept")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: no OpenMP contention on shared cores)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n_samples, length, repeats = (4, 256, 1) if args.quick else (args.samples, args.length, args.repeats)
    spec = bench_spec()
    run = Run("train_dataloading", {"samples": n_samples, "length": length, "K": K, "ttt_steps": TTT_STEPS,
                                    "cod_ratio": COD_RATIO, "cod_floor": COD_FLOOR, "repeats": repeats,
                                    "quick": args.quick})
    samples = [synthetic_sample(length, spec, seed=i) for i in range(n_samples)]
    time_epochs(samples[:1], spec, length, 1)  # warm-up: allocator, kernels
    measured = time_epochs(samples, spec, length, repeats)
    for name, (seconds, _) in measured.items():
        print(f"{name}: {seconds:.3f} s", flush=True)
    ref = measured["P-EAGLE, precomputed mask (trainer)"][0]
    eagle3 = measured["EAGLE-3, classic loader (causal mask)"][0]
    rows = [
        [name, s, 1000 * s / n_samples, el // n_samples, s / ref, s / eagle3]
        for name, (s, el) in measured.items()
    ]
    run.add_table(
        f"Data loading per epoch: {n_samples} samples x {length} tokens, K={K}, batch 1",
        ["variant", "epoch s", "ms / sample", "elements / sample", "x P-EAGLE precomputed", "x EAGLE-3 classic"],
        rows,
        note="paper (their data, hardware): P-EAGLE 17.5 s, EAGLE-3 14.8 s (0.85x), PARD 718.5 s (41x) per epoch",
    )
    masks = time_masks(samples, spec, length)
    mask_ref = masks[MASK_VARIANTS[0]]
    run.add_table(
        "Attention mask construction alone, same epoch",
        ["mask", "epoch s", "ms / sample", "x PrecomputedMask"],
        [[name, sec, 1000 * sec / n_samples, sec / mask_ref] for name, sec in masks.items()],
    )
    run.finish([
        "synthetic samples (10% prompt, 90% response), hidden [n, 4, 192] fp32; the demo data set (288 train samples, 45,990 tokens: 160 tokens on average) is far shorter than 2048",
        f"EAGLE-3 rows use ttt_steps={TTT_STEPS} (= K) so both objectives supervise the same depths",
        f"best of {repeats} epoch(s) per variant; variants interleaved sample by sample (same machine load); one process, no DataLoader workers",
    ])


if __name__ == "__main__":
    main()
