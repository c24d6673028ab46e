"""EAGLE-3's loss: the shared KL (``peagle.objective.loss.kl_loss``) over every training-time
test step's supervised elements."""

from __future__ import annotations

import torch
from torch import nn

from peagle.methods.eagle3.ttt import ttt_passes
from peagle.objective.batch import Batch
from peagle.objective.loss import LossKind, LossOutput, TargetHead, Weighting, kl_loss, supervised_rows


def eagle3_loss(
    drafter: nn.Module,
    target_head: TargetHead,
    batch: Batch,
    ttt_steps: int,
    weighting: Weighting = "uniform",
    denominator: float | torch.Tensor | None = None,
    k: int | None = None,
    unaccepted_weight: float = 1.0,
    kind: LossKind = "kl",
) -> LossOutput:
    """TTT loss over a batch of ``build_eagle3_example`` examples (same ``LossOutput`` as P-EAGLE).

    Step j charges the supervised depth-j elements; ``denominator`` / ``weighting`` as in
    ``kl_loss`` (pass the whole batch's normaliser when the batch is a segment);
    ``unaccepted_weight`` and ``kind`` as in ``peagle_loss``.
    """
    logits, target_logits, depths, rows, anchors = [], [], [], [], []
    for st in ttt_passes(drafter, batch, ttt_steps):
        logits.append(st.output.logits)
        with torch.no_grad():
            target_logits.append(target_head(st.batch.target_hidden[st.logits_mask]))
        depths.append(st.batch.depth[st.logits_mask])
        rows.append(supervised_rows(st.logits_mask))
        anchors.append(st.batch.anchor[st.logits_mask])
    return kl_loss(torch.cat(logits), torch.cat(target_logits), torch.cat(depths), k or ttt_steps, weighting,
                   denominator, (torch.cat(rows), torch.cat(anchors)), unaccepted_weight, kind)
