"""Training inputs for P-EAGLE: one element per (anchor, depth), laid out depth-major.

For a document of n tokens x_0..x_{n-1} with stored hidden states (3 aux layers, then
the final pre-norm layer), anchors are p = 0..n-2 and element (p, d) is:

    d == 0: token x_{p+1} with aux feature g_p, RoPE position p    (vLLM's shifted context)
    d >= 1: the mask token with mask_hidden,     RoPE position p + d
    target: the target's distribution at position p + 1 + d (its final hidden state there
            through ``TargetHead``), supervised when that position is in the loss mask.

This is exactly the slot layout vLLM builds when drafting after anchor p: the accepted
context, then (next token, g_p), then K-1 (mask, mask_hidden) slots at consecutive positions.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Protocol

import torch

from peagle.facts import HeadSpec
from peagle.train.cod import sample_cod
from peagle.train.masks import PrecomputedMask

NUM_AUX_LAYERS = 3


class SampleLike(Protocol):
    token_ids: torch.Tensor  # Long [n]
    loss_mask: torch.Tensor  # Bool [n]
    hidden: torch.Tensor  # Float [n, 4, Ht]: aux layers, then the final pre-norm layer


@dataclass
class Example:
    """N elements of one training example (one document, or several packed)."""

    input_ids: torch.Tensor  # Long [N]
    aux_hidden: torch.Tensor  # Float [N, 3Ht], zeros where is_mask
    is_mask: torch.Tensor  # Bool [N]
    position_ids: torch.Tensor  # Long [N]
    anchor: torch.Tensor  # Long [N], index into the example's anchors (global across packed docs)
    depth: torch.Tensor  # Long [N]
    doc: torch.Tensor  # Long [N]
    target_hidden: torch.Tensor  # Float [N, Ht], final hidden of the target position (zeros if unsupervised)
    supervised: torch.Tensor  # Bool [N]

    def __len__(self) -> int:
        return self.input_ids.numel()

    @property
    def num_supervised(self) -> int:
        return int(self.supervised.sum())

    def select(self, index: torch.Tensor) -> Example:
        """The sub-example of elements ``index`` (a Long or Bool index over N)."""
        return Example(**{f.name: getattr(self, f.name)[index] for f in fields(self)})


@dataclass
class Batch:
    """Padded examples plus their [B, N, N] attention mask (True = may attend)."""

    input_ids: torch.Tensor  # Long [B, N]
    aux_hidden: torch.Tensor  # Float [B, N, 3Ht]
    is_mask: torch.Tensor  # Bool [B, N]
    position_ids: torch.Tensor  # Long [B, N]
    anchor: torch.Tensor  # Long [B, N]
    depth: torch.Tensor  # Long [B, N]
    doc: torch.Tensor  # Long [B, N], -1 on padding
    target_hidden: torch.Tensor  # Float [B, N, Ht]
    supervised: torch.Tensor  # Bool [B, N]
    valid: torch.Tensor  # Bool [B, N], False on padding
    attention_mask: torch.Tensor  # Bool [B, N, N]

    @property
    def num_supervised(self) -> int:
        return int(self.supervised.sum())

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


def _document_elements(
    sample: SampleLike,
    spec: HeadSpec,
    k_train: int,
    cod_ratio: float,
    cod_floor: float,
    max_len: int,
    generator: torch.Generator | None,
) -> list[dict[str, torch.Tensor]]:
    """Per-depth element tensors of one document (truncated to ``max_len`` tokens)."""
    _check_sample(sample, spec)
    tokens = sample.token_ids[:max_len].long()
    loss_mask = sample.loss_mask[:max_len].bool()
    hidden = sample.hidden[:max_len].float()
    n_tok = tokens.numel()
    if n_tok < 2:
        raise ValueError(f"a document needs at least 2 tokens to make one training element, got {n_tok}")
    ht = spec.target_hidden_size
    valid = loss_mask[1:]  # anchor p is supervised at depth 0 iff position p+1 is
    per_depth = []
    for d, anchors in enumerate(sample_cod(valid, k_train, cod_ratio, cod_floor, generator)):
        target_pos = anchors + 1 + d
        supervised = loss_mask[target_pos]
        m = anchors.numel()
        if d == 0:
            input_ids = tokens[anchors + 1]
            aux = hidden[anchors, :NUM_AUX_LAYERS].reshape(m, NUM_AUX_LAYERS * ht)
        else:
            input_ids = torch.full((m,), spec.mask_token_id, dtype=torch.long)
            aux = hidden.new_zeros(m, NUM_AUX_LAYERS * ht)
        target = hidden[target_pos, NUM_AUX_LAYERS] * supervised[:, None]
        per_depth.append(
            dict(
                input_ids=input_ids,
                aux_hidden=aux,
                is_mask=torch.full((m,), d > 0),
                position_ids=anchors + d,
                anchor=anchors,
                depth=torch.full((m,), d, dtype=torch.long),
                target_hidden=target,
                supervised=supervised,
            )
        )
    return per_depth


def build_peagle_example(
    sample: SampleLike | list[SampleLike],
    spec: HeadSpec,
    k_train: int,
    cod_ratio: float,
    cod_floor: float,
    max_len: int,
    generator: torch.Generator | None = None,
) -> Example:
    """COD-sample the elements of one document (or several packed ones) into an Example.

    Packed documents get consecutive anchor ranges and their own doc id; positions restart
    at 0 in each. Their total token count must fit ``max_len``.
    """
    samples = sample if isinstance(sample, (list, tuple)) else [sample]
    if len(samples) > 1 and sum(s.token_ids.numel() for s in samples) > max_len:
        raise ValueError(f"packed documents hold more than max_len={max_len} tokens; pack fewer")
    docs = [_document_elements(s, spec, k_train, cod_ratio, cod_floor, max_len, generator) for s in samples]
    offset, parts = 0, []
    for doc_id, (s, per_depth) in enumerate(zip(samples, docs)):
        for d, part in enumerate(per_depth):
            parts.append((d, doc_id, part, offset))
        offset += min(s.token_ids.numel(), max_len) - 1
    parts.sort(key=lambda x: (x[0], x[1]))  # depth-major, then document: anchors stay sorted
    columns = {}
    for key in parts[0][2]:
        columns[key] = torch.cat([p[key] + off if key == "anchor" else p[key] for _, _, p, off in parts])
    columns["doc"] = torch.cat([torch.full((len(p["anchor"]),), doc_id, dtype=torch.long) for _, doc_id, p, _ in parts])
    return Example(**columns)


def collate(examples: list[Example], mask: PrecomputedMask) -> Batch:
    """Pad examples to the longest and build each one's attention mask from ``mask``."""
    if not examples:
        raise ValueError("collate needs at least one example")
    b, n = len(examples), max(len(e) for e in examples)
    first = examples[0]

    def pad(name: str, fill) -> torch.Tensor:
        t = getattr(first, name)
        out = torch.full((b, n, *t.shape[1:]), fill, dtype=t.dtype)
        for i, e in enumerate(examples):
            out[i, : len(e)] = getattr(e, name)
        return out

    attention = torch.zeros(b, n, n, dtype=torch.bool)
    valid = torch.zeros(b, n, dtype=torch.bool)
    for i, e in enumerate(examples):
        mask.mask_for(e.anchor, e.depth, e.doc, out=attention[i, : len(e), : len(e)])
        valid[i, : len(e)] = True
    return Batch(
        input_ids=pad("input_ids", 0),
        aux_hidden=pad("aux_hidden", 0.0),
        is_mask=pad("is_mask", False),
        position_ids=pad("position_ids", 0),
        anchor=pad("anchor", 0),
        depth=pad("depth", 0),
        doc=pad("doc", -1),
        target_hidden=pad("target_hidden", 0.0),
        supervised=pad("supervised", False),
        valid=valid,
        attention_mask=attention,
    )
