"""P-EAGLE's loss: one forward pass over every (anchor, depth) element of the training layout,
scored against the target by the shared KL (``peagle.objective.loss.kl_loss``)."""

from __future__ import annotations

import torch
from torch import nn

from peagle.objective.batch import Batch
from peagle.objective.loss import LossKind, LossOutput, TargetHead, Weighting, kl_loss, supervised_rows


def one_pass(drafter: nn.Module, batch: Batch):
    """The drafter over every element of ``batch`` at once, logits at its supervised elements: how
    P-EAGLE trains and drafts."""
    return drafter(
        input_ids=batch.input_ids,
        aux_hidden=batch.aux_hidden,
        position_ids=batch.position_ids,
        attention_mask=batch.attention,
        is_mask=batch.is_mask,
        logits_mask=batch.supervised,
    )


def peagle_loss(
    drafter: nn.Module,
    target_head: TargetHead,
    batch: Batch,
    weighting: Weighting = "uniform",
    denominator: float | torch.Tensor | None = None,
    k: int | None = None,
    unaccepted_weight: float = 1.0,
    kind: LossKind = "kl",
) -> LossOutput:
    """Run the drafter over a batch and score its supervised elements against the target.

    ``k`` sizes the per-depth statistics (default: the deepest depth in the batch + 1;
    pass train.peagle.k_train so metrics from different batches line up).
    """
    supervised = batch.supervised
    out = one_pass(drafter, batch)
    with torch.no_grad():
        target_logits = target_head(batch.target_hidden[supervised])
    depth = batch.depth[supervised]
    if k is None:
        k = int(batch.depth.max()) + 1 if batch.depth.numel() else 1
    chain = (supervised_rows(supervised), batch.anchor[supervised])
    return kl_loss(out.logits, target_logits, depth, k, weighting, denominator, chain, unaccepted_weight, kind)
