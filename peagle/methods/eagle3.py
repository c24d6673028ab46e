"""EAGLE-3: the same head trained autoregressively with training-time test (TTT), one draft per pass.

EAGLE-3 drafts one token per forward pass. vLLM (``llm_base_proposer.py``, non-parallel
path) runs step 0 on the accepted context, (x_{p+1}, fc(g_p)) at position p, then each
step j >= 1 feeds ONE new slot at position p + j: the token drafted at step j-1 and, as
its hidden state, the drafter's own pre-final-norm output of step j-1 (``prenorm``,
``DrafterOutput.hidden``; it bypasses ``fc``). Its query sees the context up to p and the
earlier steps of its own chain through the KV cache.

Training-time test reproduces that: element (p, j) of a P-EAGLE-layout example is step j
after anchor p. Choices (as in the EAGLE-3 paper's TTT): the token fed at step j >= 1 is
the ground-truth x_{p+j+1}, not the drafted one; gradients flow through the fed-back
hidden states; the RoPE position of step j is p + j (vLLM's); attention is P-EAGLE's rule
(depth-0 context up to the anchor, plus the own chain), i.e. exactly the KV cache view.
Step j is one forward pass over every element of depth <= j; the shallower elements are
recomputed with the same inputs, which gives the same values as cached keys/values.

Loss: the P-EAGLE objective's KL and weighting over all charged (anchor, step) elements.
The exported head uses the same weight names; ``mask_hidden`` stays untrained (served
WITHOUT ``parallel_drafting``).

Reading the metrics: ``acc/depth_j`` (j >= 1) averages over EVERY anchor, including those
whose step j-1 was wrong; acceptance at draft position j+1 is the accuracy over the anchors
whose steps 0..j-1 were right (on those, drafting feeds exactly these inputs:
``tests/eval/test_offline.py``). The two differ a lot early in training: the fed-back
hidden state is layer 0's residual, so a barely trained head mostly repeats its parent's
draft, which scores at depth j mostly where step j-1 was wrong. Such a head logs a fair
acc/depth_1 yet accepts almost nothing at position 2.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial

import torch
from torch import nn

from peagle.catalogue import EAGLE3
from peagle.facts import HeadSpec
from peagle.methods.base import DraftingMethod, starts_from_trained_rows
from peagle.model.drafter import DrafterOutput
from peagle.objective import Objective
from peagle.objective.batch import Batch, Example, build_peagle_example, collate
from peagle.objective.loss import LossKind, LossOutput, TargetHead, Weighting, kl_loss, supervised_rows
from peagle.objective.masks import PrecomputedMask
from peagle.objective.partition import select_elements

# ----------------------------------------------------------------------------- examples


def with_ground_truth_tokens(example: Example) -> Example:
    """Element (p, d >= 1) reads the real next token x_{p+d+1} (TTT), not the mask token.

    Depth 0 holds every anchor in order with input x_{a+1}; anchors of packed documents
    are consecutive, and (p, d) exists only while p + d + 1 is inside p's document, so
    x_{p+d+1} is the depth-0 input of anchor p + d.
    """
    zero = example.depth == 0
    next_token = torch.empty(int(example.anchor.max()) + 1, dtype=torch.long)
    next_token[example.anchor[zero]] = example.input_ids[zero]
    deep = ~zero
    input_ids = example.input_ids.clone()
    input_ids[deep] = next_token[example.anchor[deep] + example.depth[deep]]
    return replace(example, input_ids=input_ids, is_mask=torch.zeros_like(example.is_mask))


def build_eagle3_example(sample, spec: HeadSpec, ttt_steps: int, max_len: int) -> Example:
    """Every supervised (anchor, step < ttt_steps) element, fed ground-truth tokens (no COD)."""
    example = build_peagle_example(sample, spec, ttt_steps, cod_ratio=1.0, cod_floor=1.0, max_len=max_len)
    return with_ground_truth_tokens(example)


# ----------------------------------------------------------------------------- TTT passes


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


# ----------------------------------------------------------------------------- loss


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


# ----------------------------------------------------------------------------- the method


class Eagle3(DraftingMethod):
    description = EAGLE3

    def objective(self, train, spec: HeadSpec, target_head: TargetHead) -> Objective:
        """Training-time test over ``train.eagle3_ttt_steps`` steps, no COD subsampling."""
        steps = train.eagle3_ttt_steps

        def make_example(sample, generator):
            return build_eagle3_example(sample, spec, steps, train.max_len)

        def loss(model, batch: Batch, denominator) -> LossOutput:
            return eagle3_loss(model, target_head, batch, steps, train.loss_depth_weighting, denominator, k=steps,
                               unaccepted_weight=train.unaccepted_weight, kind=train.loss)

        return Objective(
            name=self.name,
            make_example=make_example,
            collate=partial(collate, mask=PrecomputedMask(train.max_len, steps)),
            loss=loss,
            depths=steps,
            weighting=train.loss_depth_weighting,
        )

    def prepare_drafter(self, drafter, train) -> None:
        """The embedding table stays frozen, as EAGLE-3's reference trainers keep it: every token
        it embeds is a real one, already embedded by the target. lm_head trains. (On a real
        vocabulary the table is most of the drafter: SmolLM2's 28M of 37M values.) A drafter
        narrower than its target starts with a random table, which must train unless a warm
        start brings a trained one."""
        if starts_from_trained_rows(drafter.spec, train):
            drafter.embed_tokens.weight.requires_grad_(False)

    def draft(self, drafter, batch, k, to_target_ids):
        """K passes, each step fed its parent's drafted token and pre-norm hidden state (vLLM's)."""
        anchor, depth, tokens = [], [], []
        for st in ttt_passes(drafter, batch, k, to_target_ids=to_target_ids):
            anchor.append(st.batch.anchor[st.logits_mask])
            depth.append(st.batch.depth[st.logits_mask])
            tokens.append(to_target_ids(st.output.logits.argmax(-1)))
        return torch.cat(anchor), torch.cat(depth), torch.cat(tokens)

    def card_training(self, train, spec) -> dict[str, str]:
        if train.init_from:
            trained = "all but the embedding table (the warm start head's)"
        elif starts_from_trained_rows(spec, train):
            trained = "all but the embedding table (the target's)"
        else:
            trained = "all (the embedding table too: this drafter is narrower than its target and started it random)"
        return {"method": "EAGLE-3 (training-time test)", "TTT steps": str(train.eagle3_ttt_steps),
                "trained parameters": trained}


METHOD = Eagle3()
