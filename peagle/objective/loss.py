"""The training loss: forward KL(target || drafter) over the draft vocabulary, or (``train.recipe.loss:
cross_entropy``) cross-entropy on the target's greedy token.

The target's distribution at a position comes from its stored final (pre-norm) hidden
state through the target's own final RMSNorm and the lm_head rows of the draft
vocabulary (``TargetHead``, frozen). Public ports sum the KL over supervised elements and
divide by their count ("uniform"); one early port averaged per-depth means
("per_depth_mean"). Both are here so the choice can be measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from peagle.facts import HeadSpec
from peagle.model.drafter import RMSNorm
from peagle.model.target_weights import load_target_tensors, target_config


@dataclass(frozen=True)
class Depth0Share:
    """Depth 0 (the next token, every anchor) gets ``share`` of the loss and the parallel
    depths the rest, each part a mean over its elements. Under "uniform" depth 0's share is
    only 1 / sum(r^d) (~27% at K 6, COD 0.8), and it is the draft every step's acceptance
    starts with."""

    share: float


Weighting = Literal["uniform", "per_depth_mean"] | Depth0Share


class TargetHead(nn.Module):
    """Frozen target final norm + lm_head rows of the draft vocabulary: hidden -> logits."""

    def __init__(self, hidden_size: int, draft_vocab_size: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.lm_head = nn.Linear(hidden_size, draft_vocab_size, bias=False)
        self.requires_grad_(False)

    @classmethod
    def from_target(cls, target_path: str, spec: HeadSpec, draft_ids: torch.Tensor) -> TargetHead:
        draft_ids = torch.as_tensor(draft_ids, dtype=torch.long)
        if spec.draft_vocab_size is not None and draft_ids.numel() != spec.draft_vocab_size:
            raise ValueError(f"draft_ids has {draft_ids.numel()} entries, spec.draft_vocab_size is {spec.draft_vocab_size}")
        weights = load_target_tensors(target_path, draft_ids)
        eps = float(target_config(target_path).get("rms_norm_eps", spec.rms_norm_eps))
        head = cls(spec.target_hidden_size, draft_ids.numel(), eps)
        if weights["norm"].shape != (spec.target_hidden_size,):
            raise ValueError(
                f"target final norm has shape {tuple(weights['norm'].shape)}, spec says Ht={spec.target_hidden_size}"
            )
        with torch.no_grad():
            head.norm.weight.copy_(weights["norm"])
            head.lm_head.weight.copy_(weights["lm_head"])
        return head

    def forward(self, final_hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(final_hidden.to(self.lm_head.weight.dtype)))


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    loss_sum: torch.Tensor  # detached sum of per-element KL
    num_supervised: int
    metrics: dict[str, float]
    # Per-depth sums (Float [K]) so segments / ranks can be aggregated exactly.
    depth_stats: dict[str, torch.Tensor] = field(default_factory=dict)


def forward_kl(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """KL(p_target || p_draft) per row, in fp32."""
    log_q = F.log_softmax(draft_logits.float(), dim=-1)
    log_p = F.log_softmax(target_logits.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


LossKind = Literal["kl", "cross_entropy"]


def element_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, kind: LossKind) -> torch.Tensor:
    """Per-row loss: forward KL to the target's distribution, or cross-entropy on its argmax
    (the token greedy verification accepts; the rest of the distribution is not trained on)."""
    if kind == "kl":
        return forward_kl(draft_logits, target_logits)
    if kind == "cross_entropy":
        return F.cross_entropy(draft_logits.float(), target_logits.argmax(-1), reduction="none")
    raise ValueError(f"loss {kind!r} is not 'kl' or 'cross_entropy'")


def depth_statistics(kl: torch.Tensor, correct: torch.Tensor, depth: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """Per-depth KL sums, top-1 agreement counts and element counts (Float [K] each)."""
    zeros = kl.new_zeros(k)
    return {
        "kl_sum": zeros.index_add(0, depth, kl.detach().float()),
        "correct": zeros.index_add(0, depth, correct.float()),
        "count": zeros.index_add(0, depth, torch.ones_like(kl, dtype=torch.float)),
    }


def metrics_from_stats(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """``loss/depth_d``, ``acc/depth_d`` (top-1 agreement with the target) and overall ``acc``."""
    kl, correct, count = (stats[key].tolist() for key in ("kl_sum", "correct", "count"))
    metrics = {}
    for d, (s, c, n) in enumerate(zip(kl, correct, count)):
        if n > 0:
            metrics[f"loss/depth_{d}"] = s / n
            metrics[f"acc/depth_{d}"] = c / n
    total = sum(count)
    if total > 0:
        metrics["acc"] = sum(correct) / total
        metrics["kl"] = sum(kl) / total
    return metrics


def kl_loss(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    depth: torch.Tensor,
    k: int,
    weighting: Weighting = "uniform",
    denominator: float | torch.Tensor | None = None,
    chain: tuple[torch.Tensor, torch.Tensor] | None = None,
    unaccepted_weight: float = 1.0,
    kind: LossKind = "kl",
) -> LossOutput:
    """Loss over M supervised elements ([M, Vd] logits, Long [M] depths); ``kind`` is what each
    element's loss is (``element_loss``), the statistics report the KL either way.

    ``chain`` (each element's batch row and anchor, Long [M] each) with ``unaccepted_weight`` < 1
    weighs the KL of drafts greedy verification never reads (``acceptance_weights``; the
    statistics still count every element).

    ``denominator`` (for sequence partitioning / gradient accumulation): "uniform" divides
    the KL sum by it instead of M; "per_depth_mean" and ``Depth0Share`` take a Float [K] of
    per-depth counts of the whole batch.
    """
    kl = forward_kl(draft_logits, target_logits)
    trained = kl if kind == "kl" else element_loss(draft_logits, target_logits, kind)
    correct = draft_logits.argmax(-1) == target_logits.argmax(-1)
    stats = depth_statistics(kl, correct, depth, k)
    weights = None if chain is None else acceptance_weights(correct, *chain, depth, unaccepted_weight)
    weighted = trained if weights is None else trained * weights
    if weighting == "uniform":
        denom = float(kl.numel()) if denominator is None else float(denominator)
        loss = weighted.sum() / max(denom, 1.0)
    elif weighting == "per_depth_mean" or isinstance(weighting, Depth0Share):
        counts = stats["count"] if denominator is None else torch.as_tensor(denominator, dtype=torch.float, device=kl.device)
        if counts.shape != (k,):
            raise ValueError(f"{weighting} needs per-depth counts of shape [{k}], got {tuple(counts.shape)}")
        per_depth_sum = kl.new_zeros(k).index_add(0, depth, weighted)
        if isinstance(weighting, Depth0Share):
            next_token = per_depth_sum[0] / counts[0].clamp_min(1)
            parallel = per_depth_sum[1:].sum() / counts[1:].sum().clamp_min(1)
            loss = weighting.share * next_token + (1 - weighting.share) * parallel
        else:
            present = counts > 0
            loss = (per_depth_sum[present] / counts[present]).sum() / present.sum().clamp_min(1)
    else:
        raise ValueError(f"loss weighting {weighting!r} is not one of 'uniform', 'per_depth_mean', Depth0Share")
    if kl.numel() == 0:
        loss = draft_logits.sum() * 0.0  # keeps the graph (every rank must call backward)
    return LossOutput(
        loss=loss,
        loss_sum=kl.detach().sum(),
        num_supervised=int(kl.numel()),
        metrics=metrics_from_stats(stats),
        depth_stats=stats,
    )


def chain_accepted(correct: torch.Tensor, row: torch.Tensor, anchor: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """Bool [M]: every shallower supervised element of the same (row, anchor) drafts the target's
    token, i.e. greedy verification reaches this element's draft."""
    missed = torch.zeros(int(row.max()) + 1, int(anchor.max()) + 1, int(depth.max()) + 1, dtype=torch.long,
                         device=correct.device)
    missed[row, anchor, depth] = (~correct).long()
    before = missed.cumsum(-1) - missed  # misses at the depths shallower than each element
    return before[row, anchor, depth] == 0


def acceptance_weights(correct: torch.Tensor, row: torch.Tensor, anchor: torch.Tensor, depth: torch.Tensor,
                       unaccepted_weight: float) -> torch.Tensor | None:
    """Float [M] loss weights: 1 where greedy verification reaches the element's draft,
    ``unaccepted_weight`` where a shallower draft of its anchor misses (None: 1 everywhere).

    A deeper draft is only read when every shallower one was right, so its loss elsewhere
    trains the slot for drafts nobody checks (bench/quality.py's off-chain loss variants)."""
    if unaccepted_weight >= 1.0 or depth.numel() == 0:
        return None
    ok = chain_accepted(correct, row, anchor, depth)
    return torch.where(ok, 1.0, unaccepted_weight).to(torch.float32)


def supervised_rows(supervised: torch.Tensor) -> torch.Tensor:
    """Long [M]: the batch row of each supervised element (``supervised`` Bool [B, N])."""
    return torch.arange(supervised.shape[0], device=supervised.device)[:, None].expand_as(supervised)[supervised]
