"""Sequence partitioning (P-EAGLE paper, Algorithm 1): one long sequence, S forward+backward passes.

A training example of L anchors is cut at B_s = floor(s * L / S). Each element is owned by
(charged in) exactly one segment, the one holding its anchor: an anchor's whole chain of
depths trains together. (Algorithm 1 charges depth 1 in the segment of its RoPE position
p + 1, and deeper depths with their parent; keeping depth 0 with them lets the loss see
whether the chain's shallower drafts were right, ``train.recipe.unaccepted_weight``, and moves
one anchor's chain per boundary, nothing else.)

Segment s also carries, as context, every depth-0 element with anchor < B_{s+1}; those are
recomputed there but not charged. Every key an owned element may attend to (depth-0
context up to its anchor, its own chain) is therefore inside its segment, and the context
elements attend only to depth-0 elements before them, so each owned element computes
exactly what it computes in the whole example. Dividing each segment's loss by the WHOLE
batch's supervised count (``denominator``) makes the segments' gradients sum to the
single-pass gradient, while the largest attention matrix shrinks from (sum of all depths)^2
to (L + deeper elements of one segment)^2.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from peagle.objective.batch import ELEMENT_FIELDS, Batch, Example
from peagle.objective.loss import Weighting


@dataclass
class Segment:
    """One segment of an example: its elements (owned + context) and which ones it charges."""

    example: Example  # elements in their original order; ``supervised`` = supervised and owned here
    index: torch.Tensor  # Long [M]: positions of these elements in the original example
    owned: torch.Tensor  # Bool [M]: charged here (False: depth-0 context recomputed for attention)
    start: int  # anchors [start, end) are this segment's
    end: int


def segment_boundaries(num_anchors: int, segments: int) -> list[int]:
    """B_0..B_S with B_s = floor(s * L / S) (B_0 = 0, B_S = L)."""
    if segments < 1:
        raise ValueError(f"the number of segments must be >= 1, got {segments}")
    return [s * num_anchors // segments for s in range(segments + 1)]


def owner_segment(anchor: torch.Tensor, boundaries: list[int]) -> torch.Tensor:
    """Long [N]: the segment each element is charged in: the one holding its anchor, whatever
    its depth (the module doc says why)."""
    inner = torch.as_tensor(boundaries[1:-1], dtype=anchor.dtype, device=anchor.device)
    return torch.bucketize(anchor, inner, right=True)


def segment_indices(anchor: torch.Tensor, depth: torch.Tensor,
                    segments: int) -> list[tuple[torch.Tensor, torch.Tensor, int, int]]:
    """Per segment: (element index [M] in original order, owned Bool [M], start, end)."""
    num_anchors = int(anchor.max()) + 1 if anchor.numel() else 0
    bounds = segment_boundaries(num_anchors, segments)
    owner = owner_segment(anchor, bounds)
    parts = []
    for s in range(segments):
        owned = owner == s
        # A segment left empty (more segments than anchors) still carries anchor 0 as
        # context, so it is a valid (zero-loss) forward pass.
        context = (depth == 0) & (anchor < max(bounds[s + 1], 1))
        index = torch.nonzero(owned | context).squeeze(1)
        parts.append((index, owned[index], bounds[s], bounds[s + 1]))
    return parts


def partition_example(example: Example, num_segments: int) -> list[Segment]:
    """Split one example into ``num_segments`` segments (Algorithm 1); see the module doc."""
    check_depth_zero_complete(example.anchor, example.depth)
    segments = []
    for index, owned, start, end in segment_indices(example.anchor, example.depth, num_segments):
        part = example.select(index)
        part.supervised = part.supervised & owned
        segments.append(Segment(example=part, index=index, owned=owned, start=start, end=end))
    return segments


def check_depth_zero_complete(anchor: torch.Tensor, depth: torch.Tensor) -> None:
    """Partitioning relies on depth 0 holding every anchor 0..L-1 (the real context)."""
    zero = anchor[depth == 0]
    num_anchors = int(anchor.max()) + 1 if anchor.numel() else 0
    if zero.numel() != num_anchors or not torch.equal(zero.sort().values, torch.arange(num_anchors, device=zero.device)):
        raise ValueError(
            "sequence partitioning needs one depth-0 element for every anchor 0..L-1 "
            "(build examples with build_peagle_example; COD never drops depth 0)"
        )


# ----------------------------------------------------------------------------- batches


def select_elements(batch: Batch, index: list[torch.Tensor], keep_supervised: list[torch.Tensor] | None = None) -> Batch:
    """A batch of row-wise element subsets: row b keeps elements ``index[b]`` (in that order).

    The subset's attention mask is the rule evaluated on the kept elements, so it stays
    exactly the whole batch's mask restricted to them; the token-level hidden states are
    shared, not copied. ``keep_supervised[b]`` (Bool, one per kept element) further
    restricts which kept elements are supervised.
    """
    b = len(index)
    n = max((int(i.numel()) for i in index), default=0)
    device = batch.input_ids.device
    out = {}
    for name in (*ELEMENT_FIELDS, "valid"):
        t = getattr(batch, name)
        fill = -1 if name == "doc" else 0
        padded = torch.full((b, n, *t.shape[2:]), fill, dtype=t.dtype, device=device)
        for row, idx in enumerate(index):
            padded[row, : idx.numel()] = t[row, idx]
        out[name] = padded
    if keep_supervised is not None:
        for row, keep in enumerate(keep_supervised):
            out["supervised"][row, : keep.numel()] &= keep
    return Batch(**out, hidden=batch.hidden)


# ----------------------------------------------------------------------------- training step


def loss_denominator(supervised: torch.Tensor, depth: torch.Tensor, weighting: Weighting, k: int):
    """The whole batch's normaliser: supervised count ("uniform") or per-depth counts [K] (the others)."""
    if weighting == "uniform":
        return int(supervised.sum())
    return torch.bincount(depth[supervised], minlength=k).float()


def segment_batches(examples: list[Example], segments: int, collate_fn: Callable[[list[Example]], Batch]) -> Iterator[Batch]:
    """Segment s of every example, collated (its mask built) only when the segment is reached.

    The whole micro-batch is never collated: the largest mask alive is one segment's, so a
    16K-token example trains in the memory of its largest segment (Algorithm 1's point).
    """
    per_example = [partition_example(e, segments) for e in examples]
    for s in range(segments):
        yield collate_fn([segs[s].example for segs in per_example])


def examples_denominator(examples: list[Example], weighting: Weighting, k: int):
    """``loss_denominator`` of a micro-batch given as examples (before any collation)."""
    return loss_denominator(torch.cat([e.supervised for e in examples]), torch.cat([e.depth for e in examples]), weighting, k)
