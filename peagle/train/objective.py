"""The trainer's ``Objective``: what a drafting method (``peagle.methods``) gives the trainer to run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from peagle.train.partition import examples_denominator, segment_batches


@dataclass
class Objective:
    """What the trainer runs for a method: how examples are built, batched and scored.

    A micro-batch stays a list of examples until it runs: with ``train.segments`` > 1 each
    segment is collated (its mask built) only when it is reached, so the whole
    micro-batch's [N, N] mask never exists (``peagle.train.partition.segment_batches``).
    """

    name: str
    make_example: Callable[[Any, Any], Any]  # (sample, torch.Generator) -> Example
    collate: Callable[[list], Any]  # examples -> Batch (padded, with its attention mask)
    loss: Callable[[Any, Any, Any], Any]  # (model, batch, denominator) -> LossOutput
    depths: int  # K the loss and the per-depth metrics run over
    weighting: Any  # a peagle.train.loss.Weighting: how the micro-batch's normaliser is counted

    def denominator(self, examples: list) -> Any:
        """The whole micro-batch's normaliser: every segment's loss is divided by it."""
        return examples_denominator(examples, self.weighting, self.depths)

    def batches(self, examples: list, segments: int):
        """The micro-batch as ``segments`` batches (Algorithm 1), built one at a time."""
        if segments == 1:
            return iter([self.collate(examples)])
        return segment_batches(examples, segments, self.collate)
