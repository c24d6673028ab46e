"""COD sampling (from PARD): which anchors get an element at each depth.

Depth 0 keeps every anchor (it is the real context every deeper element reads). Depth d
keeps about ``n_valid * max(ratio**d, floor)`` anchors, drawn from those kept at depth
d-1, so every kept element's shallower chain exists. ``valid[p]`` says that anchor p's
depth-0 target is supervised, i.e. x_{p+1} is a response token: only such anchors are
ever drafted from when serving, so only they get chains. Element (p, d) predicts the
same position as depth 0 of anchor p+d, so it is kept only when ``valid[p + d]`` too (a
chain stops at the end of a response span).
"""

from __future__ import annotations

import math

import torch


def depth_budget(num_valid: int, depth: int, ratio: float, floor: float) -> int:
    """How many anchors depth ``depth`` keeps: round(n * max(ratio^d, floor))."""
    return int(math.floor(num_valid * max(ratio**depth, floor) + 0.5))


def sample_cod(
    valid: torch.Tensor,
    k: int,
    ratio: float,
    floor: float,
    generator: torch.Generator | None = None,
) -> list[torch.Tensor]:
    """Nested anchor sets, one sorted LongTensor per depth 0..k-1.

    ``valid``: Bool[n], anchors whose depth-0 target is supervised (inside the loss mask).
    Depth 0 is ``arange(n)``; depth d >= 1 draws uniformly without replacement from depth
    d-1's set, restricted to anchors p with ``valid[p]`` and ``valid[p + d]`` (p + d < n).
    """
    if valid.dim() != 1 or valid.dtype != torch.bool:
        raise ValueError(f"valid must be a 1-D bool tensor, got {valid.dtype} {tuple(valid.shape)}")
    if k < 1:
        raise ValueError(f"k (depths to train) must be >= 1, got {k}")
    if not (0 < ratio <= 1 and 0 <= floor <= 1):
        raise ValueError(f"COD ratio must be in (0, 1] and floor in [0, 1]; got ratio={ratio}, floor={floor}")
    n = valid.numel()
    valid = valid.cpu()
    num_valid = int(valid.sum())
    sets = [torch.arange(n, dtype=torch.long)]
    previous = sets[0][valid]
    for d in range(1, k):
        shifted = previous + d
        eligible = previous[(shifted < n) & valid[shifted.clamp_max(max(n - 1, 0))]]
        take = min(depth_budget(num_valid, d, ratio, floor), eligible.numel())
        order = torch.randperm(eligible.numel(), generator=generator)[:take]
        previous = eligible[order].sort().values
        sets.append(previous)
    return sets
