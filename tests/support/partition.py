"""Sequence partitioning run end to end outside the trainer, for tests: a collated batch split
into segment batches, and one forward+backward per segment (``peagle.objective.partition``
holds what the trainer runs: the partition of examples and ``segment_batches``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import partial

import torch
from torch import nn

from peagle.methods.peagle.loss import peagle_loss
from peagle.objective.batch import Batch, Example, collate
from peagle.objective.loss import LossOutput, TargetHead, Weighting, metrics_from_stats
from peagle.objective.masks import PrecomputedMask
from peagle.objective.partition import (
    check_depth_zero_complete,
    examples_denominator,
    loss_denominator,
    segment_batches,
    segment_indices,
    select_elements,
)

STAT_KEYS = ("kl_sum", "correct", "count")


class SegmentBatches(Sequence[Batch]):
    """The S segment batches of one batch, each built only when it is read (one alive at a time)."""

    def __init__(self, batch: Batch, rows: list[list[tuple[torch.Tensor, torch.Tensor]]], segments: int):
        self._batch, self._rows, self._segments = batch, rows, segments

    def __len__(self) -> int:
        return self._segments

    def __getitem__(self, s: int) -> Batch:
        if not -self._segments <= s < self._segments:
            raise IndexError(f"segment {s} out of range for {self._segments} segments")
        s %= self._segments
        return select_elements(self._batch, [row[s][0] for row in self._rows], [row[s][1] for row in self._rows])


def partition_batch(batch: Batch, segments: int) -> SegmentBatches:
    """Split every row of a collated batch into ``segments`` segment batches (Algorithm 1).

    Segment s of the batch holds segment s of every row; masks are sliced from the batch's
    own mask. Losses of these batches must be divided by the WHOLE batch's normaliser.
    """
    rows = []
    for row in range(batch.input_ids.shape[0]):
        valid = torch.nonzero(batch.valid[row]).squeeze(1)
        anchor, depth = batch.anchor[row, valid], batch.depth[row, valid]
        check_depth_zero_complete(anchor, depth)
        rows.append([(valid[idx], owned) for idx, owned, _, _ in segment_indices(anchor, depth, segments)])
    return SegmentBatches(batch, rows, segments)


def _as_examples(data: Example | list[Example] | Batch) -> list[Example] | None:
    if isinstance(data, Example):
        return [data]
    if isinstance(data, (list, tuple)) and all(isinstance(e, Example) for e in data):
        return list(data)
    if isinstance(data, Batch):
        return None
    raise TypeError(f"expected an Example, a list of Examples or a Batch, got {type(data).__name__}")


def partitioned_loss_backward(
    drafter: nn.Module,
    target_head: TargetHead,
    data: Example | list[Example] | Batch,
    segments: int,
    weighting: Weighting = "uniform",
    mask: PrecomputedMask | None = None,
    k: int | None = None,
    unaccepted_weight: float = 1.0,
) -> LossOutput:
    """Forward+backward ``data`` as ``segments`` segments; gradients = the single-pass gradients.

    Examples are partitioned first and each segment batch is collated (mask built) only
    when it runs, so peak memory is that of the largest segment; a ``Batch`` is split
    with ``partition_batch`` (its full mask already exists). ``mask`` defaults to a
    ``PrecomputedMask`` sized for the data. Returns the summed ``LossOutput`` (``loss``
    detached: the backward passes have already run).
    """
    examples = _as_examples(data)
    if examples is not None:
        k = k or max(int(e.depth.max()) for e in examples) + 1
        if mask is None:
            mask = PrecomputedMask(max(int(e.anchor.max()) + 1 for e in examples), k)
        denominator = examples_denominator(examples, weighting, k)
        parts = segment_batches(examples, segments, partial(collate, mask=mask))
    else:
        k = k or int(data.depth.max()) + 1
        denominator = loss_denominator(data.supervised, data.depth, weighting, k)
        parts = iter(partition_batch(data, segments))
    total = None
    for part in parts:
        out = peagle_loss(drafter, target_head, part, weighting, denominator, k=k, unaccepted_weight=unaccepted_weight)
        out.loss.backward()
        total = _accumulate(total, out)
        del out, part
    return total


def _accumulate(total: LossOutput | None, out: LossOutput) -> LossOutput:
    """Sum two segments' outputs (loss, KL sum, counts, per-depth statistics)."""
    stats = {key: out.depth_stats[key].detach().clone() for key in STAT_KEYS}
    if total is not None:
        stats = {key: total.depth_stats[key] + stats[key] for key in STAT_KEYS}
        out = replace(
            out,
            loss=total.loss + out.loss.detach(),
            loss_sum=total.loss_sum + out.loss_sum,
            num_supervised=total.num_supervised + out.num_supervised,
        )
    else:
        out = replace(out, loss=out.loss.detach())
    return replace(out, depth_stats=stats, metrics=metrics_from_stats(stats))
