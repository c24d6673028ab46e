"""COD sampling (from PARD): which anchors get an element at each depth.

Depth 0 keeps every anchor (it is the real context every deeper element reads). Depth d
keeps about ``n_valid * max(ratio**d, floor)`` anchors, drawn from those kept at depth
d-1, so every kept element's shallower chain exists. ``valid[p]`` says that anchor p's
depth-0 target is supervised, i.e. x_{p+1} is a response token: only such anchors are
ever drafted from when serving, so only they get chains. Element (p, d) predicts the
same position as depth 0 of anchor p+d, so it is kept only when ``valid[p + d]`` too (a
chain stops at the end of a response span).

One uniform priority per anchor, drawn once, decides every depth: depth d keeps the
lowest-priority anchors among those eligible. Given depth d-1's set, the order of its
priorities is still uniformly random (the set was chosen by being lowest, not by order),
so each depth is a uniform draw without replacement from its eligible anchors, as with a
fresh permutation per depth. Indices are numpy arrays while the depths are walked:
sampling is a few dozen tiny operations per document, where numpy's per-call cost is a
fraction of torch's (the trainer builds one example per document per step).
"""

from __future__ import annotations

import math

import numpy as np
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
    return [torch.from_numpy(s) for s in cod_anchor_sets(valid.cpu().numpy(), k, ratio, floor, generator)]


def cod_anchor_sets(
    valid: np.ndarray, k: int, ratio: float, floor: float, generator: torch.Generator | None = None
) -> list[np.ndarray]:
    """``sample_cod`` on numpy arrays (int64 anchors per depth), for callers that keep index arithmetic in numpy."""
    n = valid.size
    num_valid = int(valid.sum())
    priority = torch.rand(n, generator=generator).numpy()
    sets = [np.arange(n, dtype=np.int64)]
    previous = sets[0][valid]
    for d in range(1, k):
        in_range = previous[previous + d < n]
        eligible = in_range[valid[in_range + d]]
        take = min(depth_budget(num_valid, d, ratio, floor), eligible.size)
        if take < eligible.size:
            eligible = np.sort(eligible[np.argpartition(priority[eligible], take)[:take]])
        previous = eligible
        sets.append(previous)
    return sets
