"""COD sampling, attention masks, compact training inputs and the loss (the trainer builds on these)."""

from peagle.train.batch import Batch, Example, build_peagle_example, collate
from peagle.train.cod import depth_budget, sample_cod
from peagle.train.loss import LossOutput, TargetHead, forward_kl, kl_loss, peagle_loss
from peagle.train.masks import PrecomputedMask, brute_force_mask, element_mask

__all__ = [
    "Batch",
    "Example",
    "LossOutput",
    "PrecomputedMask",
    "TargetHead",
    "brute_force_mask",
    "build_peagle_example",
    "collate",
    "depth_budget",
    "element_mask",
    "forward_kl",
    "kl_loss",
    "peagle_loss",
    "sample_cod",
]
