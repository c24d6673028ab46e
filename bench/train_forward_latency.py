"""Drafter forward latency for K drafted tokens: one P-EAGLE pass vs K sequential EAGLE-3 passes.

Batch 1, a context of C accepted tokens, a 4-layer ``PEagleDrafter`` at H = 192 (the
embedded target's width) and H = 1024. Attention follows the serving rule (context up to
the anchor, plus the own chain) through ``PrecomputedMask``; logits are computed only for
the drafted slots, as vLLM does.

- P-EAGLE: ONE forward over C context elements + the next-token slot + K-1 mask slots.
- EAGLE-3, recompute: step j is a forward over the context + the j+1 chain slots, feeding
  back step j-1's pre-norm hidden state and its argmax token. ``PEagleDrafter`` has no KV
  cache, so every step recomputes the context (what training-time test does too).
- No-context proxy for a KV cache: the same two schemes with the context left out (the
  K slots in one pass vs K one-slot passes). A real cache adds, per pass, attention of the
  new slots over C cached keys to both; the proxy omits it for both.

The K-step EAGLE-3 time is the sum of its first K passes, each pass's best repetition.

    .venv/bin/python bench/train_forward_latency.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from peagle.model.drafter import PEagleDrafter  # noqa: E402
from peagle.objective.masks import PrecomputedMask  # noqa: E402

from train_common import Run, bench_spec  # noqa: E402

LAYERS = 4


def chain_inputs(spec, context: int, depth: int, with_context: bool, device=None, dtype=torch.float32):
    """Elements of one draft: depth-0 anchors 0..C (context + next-token slot), then the
    chain (anchor C, depth 1..depth-1). Without context only anchor C's chain is kept."""
    first = 0 if with_context else context
    anchor = torch.cat([torch.arange(first, context + 1), torch.full((depth - 1,), context)])
    depth_ids = torch.cat([torch.zeros(context + 1 - first, dtype=torch.long), torch.arange(1, depth)])
    n = anchor.numel()
    g = torch.Generator().manual_seed(0)
    return dict(
        input_ids=torch.randint(4, spec.vocab_size, (1, n), generator=g).to(device),
        aux_hidden=torch.randn(1, n, 3 * spec.target_hidden_size, generator=g).to(device, dtype),
        position_ids=(anchor + depth_ids)[None].to(device),
        anchor=anchor,
        depth=depth_ids,
    )


def attention(mask: PrecomputedMask, inputs, device=None) -> torch.Tensor:
    anchor, depth = inputs["anchor"], inputs["depth"]
    return mask.mask_for(anchor - anchor.min(), depth)[None].to(device)


def clock(device) -> float:
    """Now, once the device has finished what it was given (a GPU runs behind the host)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def peagle_pass(drafter, mask, spec, context: int, k: int, with_context: bool, device=None, dtype=torch.float32) -> float:
    """Seconds for one P-EAGLE pass drafting k tokens (inputs and mask built beforehand)."""
    x = chain_inputs(spec, context, k, with_context, device, dtype)
    attn = attention(mask, x, device)
    is_mask = (x["depth"] > 0)[None].to(device)
    slots = torch.zeros_like(is_mask)
    slots[0, -k:] = True
    start = clock(device)
    drafter(x["input_ids"], x["aux_hidden"], x["position_ids"], attn, is_mask=is_mask, logits_mask=slots)
    return clock(device) - start


def eagle3_chain(drafter, mask, spec, context: int, steps: int, with_context: bool, device=None,
                 dtype=torch.float32) -> list[float]:
    """Seconds of each of ``steps`` sequential EAGLE-3 passes of one chain (KV-less)."""
    full = chain_inputs(spec, context, steps, with_context, device, dtype)
    attns = [attention(mask, _take(full, j), device) for j in range(steps)]  # masks: loader work, not timed
    per_step = []
    hidden, token = None, None
    for j in range(steps):
        x = _take(full, j)
        n = x["anchor"].numel()
        slot = torch.zeros(1, n, dtype=torch.bool, device=device)
        slot[0, -1] = True
        start = clock(device)
        ids, override, override_mask = x["input_ids"], None, None
        if j > 0:  # step j reads step j-1's drafted token and pre-norm hidden state
            ids = ids.clone()
            ids[0, -1] = token
            override = torch.zeros(1, n, spec.hidden_size, device=device, dtype=dtype)
            override[0, -1] = hidden
            override_mask = slot
        out = drafter(ids, x["aux_hidden"], x["position_ids"], attns[j], hidden_override=override,
                      override_mask=override_mask, logits_mask=slot)
        token, hidden = int(out.logits[-1].argmax()), out.hidden[0, -1]
        per_step.append(clock(device) - start)
    return per_step


def _take(full, step: int):
    """The inputs of EAGLE-3 step ``step``: everything up to chain depth ``step``."""
    n = full["anchor"].numel() - (full["depth"] > step).sum().item()
    return {key: (v[:n] if v.dim() == 1 else v[:, :n]) for key, v in full.items()}


def measure(hidden: int, vocab: int, draft_vocab: int, context: int, ks: list[int], reps: int) -> list[list]:
    return measure_spec(bench_spec(hidden=hidden, layers=LAYERS, vocab=vocab, draft_vocab=draft_vocab), context, ks, reps)


def measure_spec(spec, context: int, ks: list[int], reps: int, device=None, dtype=torch.float32) -> list[list]:
    """Rows [H, mode, K, P-EAGLE ms, EAGLE-3 ms, ratio] for a drafter of ``spec`` on ``device``."""
    torch.manual_seed(0)
    drafter = PEagleDrafter(spec).eval().to(device, dtype)
    mask = PrecomputedMask(context + max(ks) + 1, max(ks))
    rows = []
    with torch.inference_mode():
        for with_context in (True, False):
            peagle_pass(drafter, mask, spec, context, max(ks), with_context, device, dtype)  # warm-up
            eagle3_chain(drafter, mask, spec, context, 2, with_context, device, dtype)
            pe_times, chains = {k: [] for k in ks}, []
            # no-context passes are cheap; interleaved, so both schemes see the same machine load
            for _ in range(reps if with_context else 4 * reps):
                for k in ks:
                    pe_times[k].append(peagle_pass(drafter, mask, spec, context, k, with_context, device, dtype))
                chains.append(eagle3_chain(drafter, mask, spec, context, max(ks), with_context, device, dtype))
            pe = {k: min(t) for k, t in pe_times.items()}
            step_best = [min(c[j] for c in chains) for j in range(max(ks))]
            e3 = {k: sum(step_best[:k]) for k in ks}
            mode = f"recompute, context {context}" if with_context else "no-context proxy (KV cache)"
            for k in ks:
                rows.append([spec.hidden_size, mode, k, 1000 * pe[k], 1000 * e3[k], e3[k] / pe[k]])
            print(f"H={spec.hidden_size} {mode}: done", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="H=192 only, short context, K in {1, 4}")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--reps", type=int, default=5, help="repetitions at H=192")
    parser.add_argument("--reps-large", type=int, default=2, help="repetitions at H=1024 (seconds per pass on CPU)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        shapes, ks, context, reps = [(192, 4096, 2048)], [1, 4], 64, 2
        reps_for = {192: reps}
    else:
        shapes, ks, context, reps = [(192, 4096, 2048), (1024, 32000, 32000)], list(range(1, 12)), args.context, args.reps
        reps_for = {192: reps, 1024: args.reps_large}
    run = Run("train_forward_latency", {"shapes_H_V_Vd": shapes, "layers": LAYERS, "K": ks, "context": context,
                                        "batch": 1, "reps": reps_for, "threads": args.threads, "quick": args.quick})
    rows = []
    for hidden, vocab, draft_vocab in shapes:
        rows += measure(hidden, vocab, draft_vocab, context, ks, reps_for[hidden])
    run.add_table(
        f"Drafter forward latency, batch 1, {LAYERS} layers, fp32 CPU: one P-EAGLE pass vs K EAGLE-3 passes",
        ["H", "mode", "K", "P-EAGLE ms", "EAGLE-3 ms", "EAGLE-3 / P-EAGLE"],
        rows,
    )
    run.finish([
        f"best (min) of {reps_for} (per H; x4 for the no-context rows) interleaved repetitions after a warm-up, "
        f"{torch.get_num_threads()} torch thread(s); inference_mode; masks built before timing",
        "EAGLE-3 K-step time = sum over its first K passes of each pass's best time (P-EAGLE: the best time of its one pass)",
        "PEagleDrafter has no KV cache: 'recompute' re-runs the context each step; "
        "the proxy rows drop the context from both schemes",
        "H=192: 3 heads x 64 (1 KV head), MLP 512, V=4096, Vd=2048; H=1024: 16 heads x 64 (4 KV), MLP 2688, V=Vd=32000",
    ])


if __name__ == "__main__":
    main()
