"""Offline acceptance: simulate greedy speculative decoding as vLLM runs it, on stored states.

What is simulated on (``offline_split``): the dataset's served split
(``peagle.data.served``: the evaluation prompts, tokenised as the online evaluation sends
them, followed by the target's own greedy tokens as vLLM produced them), so the number
predicts vLLM's on the same prompts; a dataset without one falls back to the held-out split.

How drafts are counted (``walk_drafts``), as vLLM does: decoding walks through each
generated span. After the target produces a token x_{p+1} (anchor p) the drafter proposes
K tokens; draft k is accepted while it equals the reference token at p+1+k and every
earlier draft was accepted; the target then adds one token of its own, so the next draft
starts at anchor p + accepted + 1. Acceptance length = 1 + accepted per draft, averaged
over DRAFTS, not over every position: an average over every anchor counts an easy stretch
once per token where vLLM drafts it once per accepted run, and overestimates vLLM's; the
walk on the served split matches vLLM's counters (``tests/eval/test_offline_predicts_vllm.py``
holds it to them). Drafting stops once the request has ``max_tokens``
tokens (the served split's budget), but an accepted draft may match tokens past it, as in
vLLM, which counts what it verified before truncating the output. Per-position rates are
vLLM's "accepted per position": P(draft k accepted) per draft.

Reference tokens (``reference``):
- "data" (default): the stored next tokens: the target's greedy tokens (the served split
  and greedy regeneration, ``data.regenerate.temperature: 0``); a token outside the
  draft vocabulary is (correctly) never matched.
- "target": argmax of the target's distribution (``TargetHead`` on the stored final
  hidden state, over the draft vocabulary, mapped to target ids), for sampled data.

Drafting (K = max(ks); a drafter's draft k does not depend on later slots, so one run
gives every smaller K) is the method's (``DraftingMethod.draft``) over one layout: depth 0
for every anchor (the context), depths 1..K-1 (mask slots) for the drafted anchors, the
exact attention rule. P-EAGLE drafts it in one pass; EAGLE-3 in K passes feeding each step
its own drafted token and pre-norm hidden state, as vLLM's sequential proposer does.
Anchors are processed ``chunk_anchors`` at a time (each chunk recomputes the depth-0
context up to its last anchor) to bound memory on long sequences.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from peagle.catalogue import DEFAULT_METHOD, describe
from peagle.data.vocab import DraftVocab
from peagle.facts import HeadSpec
from peagle.layout import DataLayout
from peagle.methods import get_method
from peagle.objective.batch import NUM_AUX_LAYERS, Batch, slot_input_ids
from peagle.objective.loss import TargetHead

Reference = Literal["data", "target"]


@dataclass
class OfflineResult:
    acceptance_length: dict[int, float]  # K -> 1 + accepted drafts per draft, decoding as vLLM does
    per_position: list[float]  # P(draft k accepted) per draft at K = max(ks), k = 1..max(ks)
    num_anchors: int  # positions drafted from (the drafts of every K are among them)
    num_samples: int = 0
    method: str = DEFAULT_METHOD
    reference: str = "data"
    num_drafts: dict[int, int] = field(default_factory=dict)  # K -> drafts the walk made
    split: str = ""  # the split simulated on
    # vLLM's n-gram lookup (no head) walked the same way on the same split: K -> tokens per target
    # step over every decode step (vLLM's own count leaves out the steps where the lookup matched nothing)
    ngram_acceptance_length: dict[int, float] = field(default_factory=dict)
    # Per draft position k = 1..max(ks), over every drafting anchor: the share of positions n-gram
    # lookup drafts right, and the head's accuracy where it does and where it does not.
    versus_ngram: dict[str, list[float]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


# ----------------------------------------------------------------------------- anchors, references


def drafting_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """Anchors p where vLLM would draft: x_{p+1} and x_{p+2} are assistant tokens."""
    n = loss_mask.numel()
    if n < 3:
        return torch.zeros(0, dtype=torch.long)
    return torch.nonzero(loss_mask[1:-1] & loss_mask[2:]).squeeze(1)


def reference_tokens(
    sample, reference: Reference, target_head: TargetHead | None, vocab: DraftVocab, batch_size: int = 4096
) -> torch.Tensor:
    """Long [n]: the token greedy decoding produces at each position (index 0 is unused)."""
    if reference == "data":
        return sample.token_ids.long()
    if reference != "target":
        raise ValueError(f"reference {reference!r} is not 'data' or 'target'")
    if target_head is None:
        raise ValueError("reference='target' needs the target head (TargetHead.from_target)")
    device = target_head.lm_head.weight.device
    final = sample.hidden[:, NUM_AUX_LAYERS]
    draft = torch.cat(
        [target_head(final[i : i + batch_size].to(device)).argmax(-1).cpu() for i in range(0, final.shape[0], batch_size)]
    )
    out = torch.zeros_like(sample.token_ids, dtype=torch.long)
    out[1:] = vocab.to_target(draft[:-1])  # the state at q-1 predicts position q
    return out


def right_drafts(drafts: torch.Tensor, anchors: torch.Tensor, reference: torch.Tensor,
                 loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Bool [A, K] draft k equals the reference at p+1+k, Bool [A, K] that position is an answer token)."""
    k = drafts.shape[1]
    positions = anchors[:, None] + 1 + torch.arange(1, k + 1)[None, :]
    inside = positions < reference.numel()
    clamped = positions.clamp_max(reference.numel() - 1)
    counted = inside & loss_mask[clamped]
    return counted & (drafts == reference[clamped]), counted


def accepted_counts(drafts: torch.Tensor, anchors: torch.Tensor, reference: torch.Tensor,
                    loss_mask: torch.Tensor) -> torch.Tensor:
    """Long [A]: leading drafts (of [A, K]) that match the reference at positions p+2..p+K+1."""
    return right_drafts(drafts, anchors, reference, loss_mask)[0].long().cumprod(1).sum(1)


def generated_spans(loss_mask: torch.Tensor) -> list[tuple[int, int]]:
    """(first, last) position of each run of generated (assistant) tokens: one request each."""
    m = loss_mask.bool().long()
    edges = torch.diff(torch.cat([torch.zeros(1, dtype=torch.long), m, torch.zeros(1, dtype=torch.long)]))
    starts = torch.nonzero(edges == 1).squeeze(1).tolist()
    ends = (torch.nonzero(edges == -1).squeeze(1) - 1).tolist()
    return list(zip(starts, ends))


def walk_drafts(accepted_at: torch.Tensor, loss_mask: torch.Tensor, k: int, max_tokens: int | None = None) -> list[int]:
    """Accepted tokens of each draft vLLM makes at K = ``k``, walking every generated span.

    ``accepted_at`` (Long [n]) holds the leading matching drafts after each anchor (at any
    K >= ``k``); the walk starts after the span's first token (the target's, from prefill),
    drafts while the span has a next token and fewer than ``max_tokens`` were produced,
    and moves on by accepted + 1 (the target's own token).
    """
    out = []
    for first, last in generated_spans(loss_mask):
        p, produced = first - 1, 1
        while p + 2 <= last and (max_tokens is None or produced < max_tokens):
            a = min(int(accepted_at[p]), k)
            out.append(a)
            p += a + 1
            produced += a + 1
    return out


# ----------------------------------------------------------------------------- drafting


def _draft_batch(sample, spec: HeadSpec, anchors: torch.Tensor, k: int, device,
                 mask_slot_inputs: str = "mask") -> Batch:
    """One row: depth 0 for anchors 0..max(anchors) (context), depths 1..k-1 for ``anchors``.

    ``supervised`` marks the elements whose drafts are read (all elements of ``anchors``);
    ``mask_slot_inputs`` as the head trained (``peagle.objective.batch.slot_input_ids``).
    """
    last = int(anchors.max())
    context = torch.arange(last + 1)
    deep_anchor = anchors.repeat(k - 1)
    deep_depth = torch.arange(1, k).repeat_interleave(anchors.numel())
    anchor = torch.cat([context, deep_anchor])
    depth = torch.cat([torch.zeros_like(context), deep_depth])
    n = anchor.numel()
    is_deep = depth > 0
    tokens = sample.token_ids.long()
    input_ids = slot_input_ids(tokens, anchor, depth, spec.mask_token_id, mask_slot_inputs)
    wanted = torch.isin(anchor, anchors)
    batch = Batch(
        input_ids=input_ids[None],
        is_mask=is_deep[None],
        position_ids=(anchor + depth)[None],
        anchor=anchor[None],
        depth=depth[None],
        doc=torch.zeros(1, n, dtype=torch.long),
        hidden_row=anchor[None],  # depth 0 reads its anchor's aux states; deeper slots read none
        supervised=wanted[None],
        valid=torch.ones(1, n, dtype=torch.bool),
        hidden=sample.hidden[None].float(),
    )
    return batch.to(device)


def _drafts_from(anchor: torch.Tensor, depth: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor, k: int) -> torch.Tensor:
    """Arrange per-element drafted tokens into Long [A, K] (row = anchor, column = depth)."""
    row = torch.searchsorted(anchors, anchor)
    out = torch.full((anchors.numel(), k), -1, dtype=torch.long)
    out[row, depth] = tokens
    return out


@torch.no_grad()
def draft_tokens(
    drafter: nn.Module,
    sample,
    spec: HeadSpec,
    vocab: DraftVocab,
    anchors: torch.Tensor,
    k: int,
    method: str = DEFAULT_METHOD,
    chunk_anchors: int = 1024,
    mask_slot_inputs: str = "mask",
) -> torch.Tensor:
    """Long [A, K]: the target ids the drafter proposes after each of the sorted ``anchors``."""
    drafting = get_method(method)
    device = next(drafter.parameters()).device
    to_target = vocab.d2t.to(device)
    out = []
    for start in range(0, anchors.numel(), chunk_anchors):
        chunk = anchors[start : start + chunk_anchors]
        batch = _draft_batch(sample, spec, chunk, k, device, mask_slot_inputs)
        anchor, depth, tokens = drafting.draft(drafter, batch, k, lambda ids: ids + to_target[ids])
        out.append(_drafts_from(anchor.cpu(), depth.cpu(), tokens.cpu(), chunk, k))
    return torch.cat(out) if out else torch.zeros(0, k, dtype=torch.long)


def ngram_drafts(token_ids: torch.Tensor, anchors: torch.Tensor, k: int) -> torch.Tensor:
    """Long [A, K]: what vLLM's n-gram lookup proposes after each sorted anchor p (its context
    x_0..x_{p+1}, the prompt included), -1 where it proposes nothing."""
    from peagle.data.health import NgramLookup

    lookup = NgramLookup(token_ids.tolist())
    out = torch.full((anchors.numel(), k), -1, dtype=torch.long)
    for row, p in enumerate(anchors.tolist()):
        draft = lookup.draft(p + 2, k)
        out[row, : len(draft)] = torch.tensor(draft, dtype=torch.long)
    return out


class NgramComparison:
    """Per draft position: where n-gram lookup is right, and the head's hits there and elsewhere."""

    def __init__(self, k: int):
        self.positions, self.ngram_right = torch.zeros(k), torch.zeros(k)
        self.head_where_right, self.head_where_wrong = torch.zeros(k), torch.zeros(k)

    def add(self, head_right: torch.Tensor, ngram_right: torch.Tensor, counted: torch.Tensor) -> None:
        self.positions += counted.sum(0)
        self.ngram_right += ngram_right.sum(0)
        self.head_where_right += (head_right & ngram_right).sum(0)
        self.head_where_wrong += (head_right & counted & ~ngram_right).sum(0)

    def shares(self) -> dict[str, list[float]]:
        wrong = self.positions - self.ngram_right
        return {"ngram_right": (self.ngram_right / self.positions.clamp_min(1)).tolist(),
                "head_right_where_ngram_right": (self.head_where_right / self.ngram_right.clamp_min(1)).tolist(),
                "head_right_where_ngram_wrong": (self.head_where_wrong / wrong.clamp_min(1)).tolist()}


# ----------------------------------------------------------------------------- evaluation


def _check_inputs(ks: Sequence[int], spec: HeadSpec, vocab: DraftVocab, max_k: int | None) -> list[int]:
    ks = sorted(set(int(k) for k in ks))
    if not ks or ks[0] < 1:
        raise ValueError(f"ks must list draft lengths K >= 1, got {ks}")
    if max_k is not None and ks[-1] > max_k:
        raise ValueError(f"K={ks[-1]} exceeds the largest K this head can be evaluated at ({max_k}: the depths it "
                         "was trained for, train.peagle.k_train); lower eval.ks")
    if spec.draft_vocab_size != vocab.size:
        raise ValueError(f"spec.draft_vocab_size={spec.draft_vocab_size} but the draft vocabulary has {vocab.size} ids")
    return ks


def evaluate_offline(
    drafter: nn.Module,
    target_head: TargetHead | None,
    reader: Sequence,
    spec: HeadSpec,
    vocab: DraftVocab,
    ks: Sequence[int],
    max_samples: int | None = None,
    method: str = DEFAULT_METHOD,
    reference: Reference = "data",
    max_k: int | None = None,
    chunk_anchors: int = 1024,
    max_tokens: int | None = None,
    split: str = "",
    mask_slot_inputs: str = "mask",
    compare_ngram: bool = True,
) -> OfflineResult:
    """Simulated acceptance of ``drafter`` on the first ``max_samples`` samples of ``reader``.

    ``target_head`` is only read with ``reference="target"`` (may be None otherwise);
    ``max_k`` (the method's ``max_eval_k``) refuses larger K; ``max_tokens`` is the
    requests' generation budget (the served split's; None: each whole span); ``mask_slot_inputs``
    as the head trained (``train.peagle.mask_slot_inputs``). vLLM's n-gram lookup is walked beside the
    head on the same tokens (``ngram_acceptance_length``, ``versus_ngram``) unless ``compare_ngram``
    is false (the trainer's checkpoint choice reads only the head's acceptance).
    """
    method = describe(method)
    ks = _check_inputs(ks, spec, vocab, max_k)
    k = ks[-1]
    was_training = drafter.training
    drafter.eval()
    walks: dict[int, list[int]] = {kk: [] for kk in ks}
    ngram_walks: dict[int, list[int]] = {kk: [] for kk in ks}
    versus = NgramComparison(k)
    num_anchors = num_samples = 0
    try:
        for i in range(min(len(reader), max_samples or len(reader))):
            sample = reader[i]
            loss_mask = sample.loss_mask.bool()
            anchors = drafting_anchors(loss_mask)
            num_samples += 1
            if anchors.numel() == 0:
                continue
            drafts = draft_tokens(drafter, sample, spec, vocab, anchors, k, method.name, chunk_anchors, mask_slot_inputs)
            with torch.no_grad():
                ref = reference_tokens(sample, reference, target_head, vocab)
            found_by = [(drafts, walks)]
            if compare_ngram:
                lookup = ngram_drafts(sample.token_ids.long(), anchors, k)
                head_right, counted = right_drafts(drafts, anchors, ref, loss_mask)
                versus.add(head_right, right_drafts(lookup, anchors, ref, loss_mask)[0], counted)
                found_by.append((lookup, ngram_walks))
            num_anchors += anchors.numel()
            for found, walked in found_by:
                accepted_at = torch.zeros(loss_mask.numel(), dtype=torch.long)
                accepted_at[anchors] = accepted_counts(found, anchors, ref, loss_mask)
                for kk in ks:
                    walked[kk] += walk_drafts(accepted_at, loss_mask, kk, max_tokens)
    finally:
        drafter.train(was_training)
    if not walks[k]:
        raise ValueError(
            f"no drafting positions in {num_samples} eval samples (no two consecutive assistant tokens): "
            "check the eval split and its loss masks"
        )
    deepest = torch.tensor(walks[k])
    return OfflineResult(
        acceptance_length={kk: 1.0 + sum(w) / len(w) for kk, w in walks.items()},
        per_position=[float((deepest >= j).float().mean()) for j in range(1, k + 1)],
        num_anchors=num_anchors,
        num_samples=num_samples,
        method=method.name,
        reference=reference,
        num_drafts={kk: len(w) for kk, w in walks.items()},
        split=split,
        ngram_acceptance_length={kk: 1.0 + sum(w) / len(w) for kk, w in ngram_walks.items() if w},
        versus_ngram=versus.shares() if compare_ngram else {},
    )


def offline_split(data_dir: str | Path) -> tuple[Path, int | None]:
    """(split directory, generation budget) offline acceptance is simulated on: the served
    split (``peagle.data.served``) when the dataset has one, else the held-out split."""
    from peagle.data.served import SERVED_SPLIT, served_manifest

    data = DataLayout(data_dir)
    served = served_manifest(data)
    if served is not None:
        return data.split(SERVED_SPLIT), int(served["max_tokens"])
    return data.eval, None


def offline_eval_fn(cfg, data_dir: str | Path, target_path: str, reference: Reference = "data") -> Callable[[nn.Module], float]:
    """The trainer's ``eval_fn`` (it picks the best checkpoint): acceptance length at the largest
    usable K on ``offline_split``, the number that predicts vLLM's.

    The pipeline's training ranks (``peagle.rank``) hand it to the trainer (K beyond the method's
    ``max_eval_k`` is dropped).
    """
    from peagle.data.store import ShardReader
    from peagle.facts import load_dataset_facts

    data = DataLayout(data_dir)
    facts = load_dataset_facts(data)
    vocab = DraftVocab.load(data.vocab)
    split, max_tokens = offline_split(data_dir)
    reader = ShardReader(split)
    if len(reader) == 0:
        raise ValueError(f"{split} holds no samples: set data.heldout_samples > 0 to evaluate offline")
    method = cfg.train.method
    description = describe(method)
    ks, limit = evaluable_ks(cfg.eval.ks, description.max_eval_k(description.own(cfg.train)))
    head = TargetHead.from_target(target_path, facts, vocab.draft_ids) if reference == "target" else None

    def eval_fn(drafter: nn.Module) -> float:
        result = evaluate_offline(  # the drafter being trained carries its own spec
            drafter, head, reader, drafter.spec, vocab, ks, cfg.eval.offline_max_samples, method, reference, limit,
            max_tokens=max_tokens, split=split.name, mask_slot_inputs=drafter.spec.mask_slot_inputs,
            compare_ngram=False,  # every evaluation of a run walks the same tokens: n-gram lookup's never changes
        )
        return result.acceptance_length[max(ks)]

    return eval_fn


def evaluable_ks(ks: list[int], limit: int | None) -> tuple[list[int], int | None]:
    """(the ``ks`` a head can be evaluated at offline, its method's ``limit``: ``max_eval_k``);
    the limit itself when every K is beyond it."""
    return [k for k in ks if limit is None or k <= limit] or [limit], limit
