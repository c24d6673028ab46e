"""Training inputs for P-EAGLE: one element per (anchor, depth), laid out depth-major.

For a document of n tokens x_0..x_{n-1} with stored hidden states (3 aux layers, then
the final pre-norm layer), anchors are p = 0..n-2 and element (p, d) is:

    d == 0: token x_{p+1} with aux feature g_p, RoPE position p    (vLLM's shifted context)
    d >= 1: the mask token with mask_hidden,     RoPE position p + d
    target: the target's distribution at position p + 1 + d (its final hidden state there
            through ``TargetHead``), supervised when that position is in the loss mask.

This is exactly the slot layout vLLM builds when drafting after anchor p: the accepted
context, then (next token, g_p), then K-1 (mask, mask_hidden) slots at consecutive positions.

Batches stay compact until the step runs: an example keeps the document's token-level
hidden states once (``hidden`` [T, 4, Ht]) and each element's row in it (``hidden_row``);
its per-element features (``aux_hidden``, ``target_hidden``) and the batch's attention
mask are index arithmetic evaluated where they are read, on the batch's device. Building
a batch therefore costs index vectors of N elements, like an EAGLE-3 batch of the same
tokens, and moves ~4x fewer bytes to the accelerator than per-element copies would.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Protocol

import numpy as np
import torch

from peagle.facts import HeadSpec
from peagle.objective.cod import cod_anchor_sets
from peagle.objective.masks import ElementAttention, PrecomputedMask

NUM_AUX_LAYERS = 3


class SampleLike(Protocol):
    token_ids: torch.Tensor  # Long [n]
    loss_mask: torch.Tensor  # Bool [n]
    hidden: torch.Tensor  # Float [n, 4, Ht]: aux layers, then the final pre-norm layer


ELEMENT_FIELDS = ("input_ids", "is_mask", "position_ids", "anchor", "depth", "doc", "hidden_row", "supervised")


def aux_features(hidden: torch.Tensor, hidden_row: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """Float [..., N, 3Ht]: the anchor's aux hidden states at depth 0, zeros deeper.

    ``hidden`` [..., T, 4, Ht] (per row), ``hidden_row`` / ``depth`` [..., N].
    """
    return _rows_where(hidden[..., :NUM_AUX_LAYERS, :], hidden_row, depth == 0)


def target_features(hidden: torch.Tensor, hidden_row: torch.Tensor, depth: torch.Tensor,
                    supervised: torch.Tensor) -> torch.Tensor:
    """Float [..., N, Ht]: the final hidden state at position anchor + 1 + depth where supervised, else zeros."""
    return _rows_where(hidden[..., NUM_AUX_LAYERS, :], hidden_row + 1 + depth, supervised)


def _rows_where(values: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Float [..., N, prod(F)]: ``values`` [..., T, *F] at ``rows`` [..., N] where ``keep``, zeros elsewhere.

    Only the kept rows are read (one row copy each), the rest is a zero fill.
    """
    lead = rows.dim() - 1
    t = values.shape[lead]
    width = values[(0,) * (lead + 1)].numel()
    tokens = values.flatten(0, lead)  # (batch row, token) -> one index; a view for the trainer's tensors
    base = torch.arange(rows[..., :1].numel(), device=rows.device).reshape(*rows.shape[:-1], 1) * t
    picked = tokens.index_select(0, (rows + base)[keep])
    out = values.new_zeros(*rows.shape, width)
    out[keep] = picked.reshape(picked.shape[0], width)
    return out


@dataclass
class Example:
    """N elements of one training example (one document, or several packed).

    ``hidden`` is the documents' token-level states, shared by all elements (not copied per
    element); ``aux_hidden`` and ``target_hidden`` are gathered from it when read.
    """

    input_ids: torch.Tensor  # Long [N]
    is_mask: torch.Tensor  # Bool [N]
    position_ids: torch.Tensor  # Long [N]
    anchor: torch.Tensor  # Long [N], index into the example's anchors (global across packed docs)
    depth: torch.Tensor  # Long [N]
    doc: torch.Tensor  # Long [N]
    hidden_row: torch.Tensor  # Long [N]: the anchor's token row in ``hidden`` (the target is 1 + depth rows on)
    supervised: torch.Tensor  # Bool [N]
    hidden: torch.Tensor  # Float [T, 4, Ht]: aux layers then the final layer, per token

    def __len__(self) -> int:
        return self.input_ids.numel()

    @property
    def num_supervised(self) -> int:
        return int(self.supervised.sum())

    @property
    def aux_hidden(self) -> torch.Tensor:
        """Float [N, 3Ht], zeros where depth > 0."""
        return aux_features(self.hidden, self.hidden_row, self.depth)

    @property
    def target_hidden(self) -> torch.Tensor:
        """Float [N, Ht]: final hidden of the target position (zeros if unsupervised)."""
        return target_features(self.hidden, self.hidden_row, self.depth, self.supervised)

    def select(self, index: torch.Tensor) -> Example:
        """The sub-example of elements ``index`` (a Long or Bool index over N)."""
        return Example(**{name: getattr(self, name)[index] for name in ELEMENT_FIELDS}, hidden=self.hidden)


@dataclass
class Batch:
    """Padded examples: element fields [B, N], token-level ``hidden`` [B, T, 4, Ht].

    ``aux_hidden`` and ``target_hidden`` are evaluated when read, on the batch's device: the
    loss reads each once per step. ``attention`` is the P-EAGLE rule over the elements
    (``peagle.objective.masks``, padding masked out), which the drafter evaluates as a
    block-sparse or a dense mask; ``attention_mask`` is the dense one.
    """

    input_ids: torch.Tensor  # Long [B, N]
    is_mask: torch.Tensor  # Bool [B, N]
    position_ids: torch.Tensor  # Long [B, N]
    anchor: torch.Tensor  # Long [B, N]
    depth: torch.Tensor  # Long [B, N]
    doc: torch.Tensor  # Long [B, N], -1 on padding
    hidden_row: torch.Tensor  # Long [B, N], rows of this row's ``hidden``
    supervised: torch.Tensor  # Bool [B, N]
    valid: torch.Tensor  # Bool [B, N], False on padding
    hidden: torch.Tensor  # Float [B, T, 4, Ht]

    @property
    def num_supervised(self) -> int:
        return int(self.supervised.sum())

    @property
    def aux_hidden(self) -> torch.Tensor:
        """Float [B, N, 3Ht]: depth-0 elements' aux features, zeros deeper and on padding."""
        return aux_features(self.hidden, self.hidden_row, torch.where(self.valid, self.depth, 1))

    @property
    def target_hidden(self) -> torch.Tensor:
        """Float [B, N, Ht]: supervised elements' target states, zeros elsewhere."""
        return target_features(self.hidden, self.hidden_row, self.depth, self.supervised)

    @property
    def attention(self) -> ElementAttention:
        """The attention rule over the batch's elements, as their vectors (no [N, N] tensor)."""
        return ElementAttention(self.anchor, self.depth, self.doc, self.valid)

    @property
    def attention_mask(self) -> torch.Tensor:
        """Bool [B, N, N] (True = may attend): the rule as a dense mask (``element_mask``)."""
        return self.attention.dense()

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> Batch:
        """Move to ``device``; ``dtype`` casts the float tensors (hidden states) only."""
        moved = {}
        for f in fields(self):
            t = getattr(self, f.name)
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            moved[f.name] = t.to(device, non_blocking=True)
        return replace(self, **moved)


def _check_sample(sample: SampleLike, spec: HeadSpec) -> None:
    n = sample.token_ids.shape[0]
    want = (n, NUM_AUX_LAYERS + 1, spec.target_hidden_size)
    if tuple(sample.hidden.shape) != want:
        raise ValueError(
            f"sample.hidden has shape {tuple(sample.hidden.shape)}, expected {want} "
            "(tokens x [3 aux layers + final layer] x Ht); was the dataset extracted for this head spec?"
        )
    if sample.loss_mask.shape != (n,):
        raise ValueError(f"sample.loss_mask has shape {tuple(sample.loss_mask.shape)}, expected {(n,)}")


@dataclass
class _Document:
    """One document, truncated to ``max_len`` tokens, and its COD anchor sets (one per depth)."""

    tokens: np.ndarray  # int64 [n]
    loss_mask: np.ndarray  # bool [n]
    hidden: torch.Tensor  # Float [n, 4, Ht]
    anchors: list[np.ndarray]  # depth d -> sorted int64 anchors (local to the document)


def _document(
    sample: SampleLike,
    spec: HeadSpec,
    k_train: int,
    cod_ratio: float,
    cod_floor: float,
    max_len: int,
    generator: torch.Generator | None,
) -> _Document:
    _check_sample(sample, spec)
    tokens = sample.token_ids[:max_len].long().cpu().numpy()
    loss_mask = sample.loss_mask[:max_len].bool().cpu().numpy()
    if tokens.size < 2:
        raise ValueError(f"a document needs at least 2 tokens to make one training element, got {tokens.size}")
    valid = loss_mask[1:]  # anchor p is supervised at depth 0 iff position p+1 is
    anchors = cod_anchor_sets(valid, k_train, cod_ratio, cod_floor, generator)
    return _Document(tokens, loss_mask, sample.hidden[:max_len].float(), anchors)


def slot_input_ids(tokens, hidden_row, depth, mask_token_id: int, mask_slot_inputs: str = "mask"):
    """Each element's input token: x_{p+1} at depth 0; deeper, the mask token, or with
    "true_previous" the real token x_{p+1+d} before the slot's target x_{p+2+d}. Works on numpy
    arrays and torch tensors alike (``tokens`` indexed by row)."""
    where = torch.where if isinstance(tokens, torch.Tensor) else np.where
    last = len(tokens) - 1
    next_token = tokens[(hidden_row + 1).clip(max=last)]
    if mask_slot_inputs == "mask":
        return where(depth > 0, mask_token_id, next_token)
    if mask_slot_inputs == "true_previous":
        return tokens[(hidden_row + 1 + depth).clip(max=last)]
    raise ValueError(f"mask_slot_inputs {mask_slot_inputs!r} is not 'mask' or 'true_previous'")


def build_peagle_example(
    sample: SampleLike | list[SampleLike],
    spec: HeadSpec,
    k_train: int,
    cod_ratio: float,
    cod_floor: float,
    max_len: int,
    generator: torch.Generator | None = None,
    mask_slot_inputs: str = "mask",
) -> Example:
    """COD-sample the elements of one document (or several packed ones) into an Example.

    ``mask_slot_inputs="true_previous"`` gives each mask slot the real token before its target
    instead of the mask token (``slot_input_ids``): a measurement, not what vLLM drafts with.

    Packed documents get consecutive anchor ranges and their own doc id; positions restart
    at 0 in each. Their total token count must fit ``max_len``. After COD every field is
    one vectorised expression over all elements, in numpy: a few dozen operations on
    small index arrays per document, where torch's per-call cost would dominate.
    """
    samples = sample if isinstance(sample, (list, tuple)) else [sample]
    if len(samples) > 1 and sum(s.token_ids.numel() for s in samples) > max_len:
        raise ValueError(f"packed documents hold more than max_len={max_len} tokens; pack fewer")
    docs = [_document(s, spec, k_train, cod_ratio, cod_floor, max_len, generator) for s in samples]
    lengths = np.array([d.tokens.size for d in docs])
    token_start = lengths.cumsum() - lengths  # first token row of each document
    anchor_start = token_start - np.arange(len(docs))  # a document of n tokens has n - 1 anchors
    # depth-major, then document: anchors stay sorted
    pieces = [doc.anchors[d] for d in range(k_train) for doc in docs]
    counts = [a.size for a in pieces]
    local = np.concatenate(pieces)
    depth = np.repeat(np.repeat(np.arange(k_train), len(docs)), counts)
    doc = np.repeat(np.tile(np.arange(len(docs)), k_train), counts)
    hidden_row = local + token_start[doc]
    tokens = docs[0].tokens if len(docs) == 1 else np.concatenate([d.tokens for d in docs])
    loss_mask = docs[0].loss_mask if len(docs) == 1 else np.concatenate([d.loss_mask for d in docs])
    is_mask = depth > 0
    fields = {
        "input_ids": slot_input_ids(tokens, hidden_row, depth, spec.mask_token_id, mask_slot_inputs),
        "is_mask": is_mask,
        "position_ids": local + depth,
        "anchor": local + anchor_start[doc],
        "depth": depth,
        "doc": doc,
        "hidden_row": hidden_row,
        "supervised": loss_mask[hidden_row + 1 + depth],
    }
    return Example(
        **{name: torch.from_numpy(np.ascontiguousarray(value, dtype=np.bool_ if value.dtype == np.bool_ else np.int64))
           for name, value in fields.items()},
        hidden=docs[0].hidden if len(docs) == 1 else torch.cat([d.hidden for d in docs]),
    )


def collate(examples: list[Example], mask: PrecomputedMask) -> Batch:
    """Pad examples to the longest (elements and tokens); no per-element copy of hidden states.

    ``mask`` checks the examples fit the anchors and depths the objective was set up for
    (before the step runs); the batch's attention mask is evaluated when the step runs.
    """
    if not examples:
        raise ValueError("collate needs at least one example")
    for e in examples:
        mask.check(e.anchor, e.depth)
    b, n = len(examples), max(len(e) for e in examples)

    def pad(name: str, fill) -> torch.Tensor:
        t = getattr(examples[0], name)
        if b == 1:
            return t[None]  # nothing to pad: a view
        out = torch.full((b, n), fill, dtype=t.dtype)
        for i, e in enumerate(examples):
            out[i, : len(e)] = getattr(e, name)
        return out

    valid = torch.arange(n) < torch.tensor([len(e) for e in examples])[:, None]
    return Batch(
        input_ids=pad("input_ids", 0),
        is_mask=pad("is_mask", False),
        position_ids=pad("position_ids", 0),
        anchor=pad("anchor", 0),
        depth=pad("depth", 0),
        doc=pad("doc", -1),
        hidden_row=pad("hidden_row", 0),
        supervised=pad("supervised", False),
        valid=valid,
        hidden=_stack_tokens([e.hidden for e in examples]),
    )


def _stack_tokens(hidden: list[torch.Tensor]) -> torch.Tensor:
    """[B, T, 4, Ht] zero-padded to the longest; a view (no copy) for a single example."""
    if len(hidden) == 1:
        return hidden[0][None]
    t = max(h.shape[0] for h in hidden)
    out = hidden[0].new_zeros(len(hidden), t, *hidden[0].shape[1:])
    for i, h in enumerate(hidden):
        out[i, : h.shape[0]] = h
    return out
