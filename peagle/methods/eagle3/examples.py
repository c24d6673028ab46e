"""EAGLE-3's training examples: the P-EAGLE layout (``peagle.objective.batch``) with each
element (p, d >= 1) fed the real next token, as training-time test feeds it."""

from __future__ import annotations

from dataclasses import replace

import torch

from peagle.facts import HeadSpec
from peagle.objective.batch import Example, build_peagle_example


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
