"""What every drafting method's training step shares, apart from how a run is driven
(``peagle.train``): the (anchor, depth) training layout both P-EAGLE and EAGLE-3 train on.

COD anchor sets (``cod``), the attention masks of the layout (``masks``), compact training
examples and batches (``batch``), the KL against the frozen target head (``loss``), sequence
partitioning for long contexts (``partition``), and the ``Objective`` a drafting method hands the
trainer: how it builds, batches and scores examples. What only one method does (P-EAGLE's one-pass
loss, EAGLE-3's ground-truth inputs and training-time test passes) is in its own package under
``peagle.methods``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from peagle.objective.batch import Batch, Example, build_peagle_example, collate
from peagle.objective.cod import depth_budget, sample_cod
from peagle.objective.loss import LossOutput, TargetHead, forward_kl, kl_loss
from peagle.objective.masks import ElementAttention, PrecomputedMask, brute_force_mask, element_mask
from peagle.objective.partition import examples_denominator, segment_batches


@dataclass
class Objective:
    """What the trainer runs for a method: how examples are built, batched and scored.

    A micro-batch stays a list of examples until it runs: with ``train.recipe.segments`` > 1 each
    segment is collated (its mask built) only when it is reached, so the whole
    micro-batch's [N, N] mask never exists (``peagle.objective.partition.segment_batches``).
    """

    name: str
    make_example: Callable[[Any, Any], Any]  # (sample, torch.Generator) -> Example
    collate: Callable[[list], Any]  # examples -> Batch (padded, with its attention mask)
    loss: Callable[[Any, Any, Any], Any]  # (model, batch, denominator) -> LossOutput
    depths: int  # K the loss and the per-depth metrics run over
    weighting: Any  # a peagle.objective.loss.Weighting: how the micro-batch's normaliser is counted

    def denominator(self, examples: list) -> Any:
        """The whole micro-batch's normaliser: every segment's loss is divided by it."""
        return examples_denominator(examples, self.weighting, self.depths)

    def batches(self, examples: list, segments: int):
        """The micro-batch as ``segments`` batches (Algorithm 1), built one at a time."""
        if segments == 1:
            return iter([self.collate(examples)])
        return segment_batches(examples, segments, self.collate)


__all__ = [
    "Batch",
    "ElementAttention",
    "Example",
    "LossOutput",
    "Objective",
    "PrecomputedMask",
    "TargetHead",
    "brute_force_mask",
    "build_peagle_example",
    "collate",
    "depth_budget",
    "element_mask",
    "forward_kl",
    "kl_loss",
    "sample_cod",
]
