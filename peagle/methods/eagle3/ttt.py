"""Training-time test: step j is one forward pass over every element of depth <= j, each fed
its parent's token and the drafter's own pre-norm hidden state of the step before (vLLM's
non-parallel drafting, ``peagle.methods.eagle3``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from peagle.model.drafter import DrafterOutput
from peagle.objective.batch import Batch
from peagle.objective.partition import select_elements


@dataclass
class TTTStep:
    step: int
    columns: torch.Tensor  # Long [B, n]: this pass's elements as columns of the input batch (pad: N)
    batch: Batch  # this pass's elements (depth <= step)
    output: DrafterOutput  # logits only where ``logits_mask``, flattened [M, Vd]
    logits_mask: torch.Tensor  # Bool [B, n]


def parent_columns(batch: Batch) -> torch.Tensor:
    """Long [B, N]: the column of element (p, d)'s parent (p, d-1); N for depth 0 / padding."""
    b, n = batch.input_ids.shape
    stride = int(batch.depth.max()) + 1 if batch.depth.numel() else 1
    parent = torch.full((b, n), n, dtype=torch.long, device=batch.input_ids.device)
    for row in range(b):
        valid = batch.valid[row]
        anchor, depth = batch.anchor[row], batch.depth[row]
        key = anchor * stride + depth
        table = torch.full((int(key[valid].max()) + 1 if valid.any() else 1,), n, dtype=torch.long, device=parent.device)
        cols = torch.nonzero(valid).squeeze(1)
        table[key[cols]] = cols
        deep = valid & (depth > 0)
        parent[row, deep] = table[key[deep] - 1]
    deep = batch.valid & (batch.depth > 0)
    if bool((parent[deep] == n).any()):
        raise ValueError("an element (p, d) has no parent (p, d-1) in its batch: TTT chains must be complete")
    return parent


def _gather_rows(values: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """values [B, N(+1), ...] gathered at columns [B, n] -> [B, n, ...]."""
    index = columns.reshape(*columns.shape, *([1] * (values.dim() - 2))).expand(*columns.shape, *values.shape[2:])
    return values.gather(1, index)


def ttt_passes(
    drafter: nn.Module,
    batch: Batch,
    steps: int,
    to_target_ids: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Iterator[TTTStep]:
    """Run EAGLE-3 steps 0..steps-1 over a P-EAGLE-layout batch, one forward pass per step.

    Logits are computed for the step's ``supervised`` elements. Training (``to_target_ids``
    None): inputs are the batch's (ground-truth) tokens. Drafting (``to_target_ids`` maps
    draft-vocabulary ids to target ids): step j >= 1 elements read the token their parent
    drafted (its argmax), so every parent of a deeper element must be ``supervised``.
    """
    b, n = batch.input_ids.shape
    if steps < 1:
        raise ValueError(f"EAGLE-3 needs at least one step, got {steps}")
    parent = parent_columns(batch)
    fed_hidden = None  # [B, N+1, H]: each element's pre-norm output from its own step
    drafted = torch.zeros(b, n + 1, dtype=torch.long, device=batch.input_ids.device)  # drafting mode only
    for j in range(steps):
        keep = batch.valid & (batch.depth <= j)
        index = [torch.nonzero(keep[row]).squeeze(1) for row in range(b)]
        sub = select_elements(batch, index)
        columns = torch.full(sub.valid.shape, n, dtype=torch.long, device=keep.device)
        for row, idx in enumerate(index):
            columns[row, : idx.numel()] = idx
        deep = sub.valid & (sub.depth > 0)
        sub_parent = _gather_rows(torch.cat([parent, parent.new_full((b, 1), n)], 1), columns)
        override = None
        if j > 0:
            override = _gather_rows(fed_hidden, sub_parent)
            if to_target_ids is not None:
                sub.input_ids = torch.where(deep, _gather_rows(drafted, sub_parent), sub.input_ids)
        current = sub.valid & (sub.depth == j)
        logits_mask = current & sub.supervised
        out = drafter(
            input_ids=sub.input_ids,
            aux_hidden=sub.aux_hidden,
            position_ids=sub.position_ids,
            attention_mask=sub.attention,
            is_mask=None,
            hidden_override=override,
            override_mask=deep if j > 0 else None,
            logits_mask=logits_mask,
        )
        yield TTTStep(step=j, columns=columns, batch=sub, output=out, logits_mask=logits_mask)
        if j + 1 < steps:
            fed_hidden = _store(fed_hidden, out.hidden, columns, current, n)
            if to_target_ids is not None:
                tokens = torch.zeros_like(sub.input_ids)
                tokens[logits_mask] = to_target_ids(out.logits.argmax(-1))
                drafted = drafted.scatter(1, torch.where(logits_mask, columns, n), tokens)


def _store(fed: torch.Tensor | None, hidden: torch.Tensor, columns: torch.Tensor, current: torch.Tensor, n: int) -> torch.Tensor:
    """Add this step's elements' hidden states to the per-column buffer (differentiably).

    Each column is written once, at its own step; everything else lands (as zeros) in the
    dummy column N.
    """
    b, _, h = hidden.shape
    if fed is None:
        fed = hidden.new_zeros(b, n + 1, h)
    target_cols = torch.where(current, columns, n)[..., None].expand(-1, -1, h)
    src = torch.where(current[..., None], hidden, 0.0)
    return fed + torch.zeros_like(fed).scatter_add(1, target_cols, src)
