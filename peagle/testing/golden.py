"""A known-answer test of the head format in the installed vLLM.

A misnamed tensor loads silently, so only acceptance proves a head loads right. This
module builds a tiny random Llama target whose greedy output is one fixed token, and a
"golden" head wired so that it drafts exactly that token at every position, but only if
vLLM loads every piece under the name we write: ``fc``, the per-layer projections,
``norm``, ``lm_head``, the ``d2t`` offsets (the draft vocabulary skips low ids so the
draft index differs from the target id) and ``mask_hidden`` (used by slots 2..K).
Served with K speculative tokens it must reach acceptance length K + 1.

How: residual-stream dimension ``MARKER`` is held at 1 everywhere. In the target, every
embedding has 1 there and no layer writes to it (o_proj / down_proj rows are zero); its
final norm keeps only that dimension and lm_head scores the fixed token highest on it.
In the head, ``fc`` copies the marker of the first aux state (and of ``mask_hidden``),
no layer writes to it, and the head's norm/lm_head read it the same way.
"""

from __future__ import annotations

from pathlib import Path

import torch

from peagle.catalogue import DEFAULT_METHOD
from peagle.contract import expected_tensors
from peagle.facts import DrafterShape, HeadSpec, TargetFacts, head_spec
from peagle.methods import get_method

MARKER = 0  # the residual dimension both models keep at 1
MASK_TOKEN = "<|mask|>"


def build_tiny_target(
    out_dir: str | Path,
    *,
    num_layers: int = 8,
    hidden_size: int = 128,
    constant_token: int | None = None,
    seed: int = 0,
) -> Path:
    """A random Llama + tokenizer (peagle.testing.tiny); ``constant_token`` makes it always emit that id."""
    from transformers import LlamaForCausalLM

    from peagle.testing.tiny import build_tiny_llama

    out_dir = build_tiny_llama(out_dir, num_layers=num_layers, hidden_size=hidden_size, seed=seed)
    if constant_token is not None:
        model = LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
        _pin_marker_target(model, constant_token)
        model.save_pretrained(out_dir)
    return out_dir


@torch.no_grad()
def _pin_marker_target(model, token: int) -> None:
    inner = model.model
    inner.embed_tokens.weight[:, MARKER] = 1.0
    for layer in inner.layers:
        layer.self_attn.o_proj.weight[MARKER].zero_()
        layer.mlp.down_proj.weight[MARKER].zero_()
    inner.norm.weight.zero_()
    inner.norm.weight[MARKER] = 1.0
    model.lm_head.weight[:, MARKER] = -1.0
    model.lm_head.weight[token, MARKER] = 1.0


def random_head_state_dict(spec: HeadSpec, *, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """A drafter state dict with the head's names and random values (norms at one)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, rule in expected_tensors(spec, get_method(DEFAULT_METHOD).head_tensors(spec)).items():
        if rule.kind != "float":
            continue
        if name.endswith("norm.weight"):
            out[name] = torch.ones(rule.shape)
        else:
            out[name] = torch.randn(rule.shape, generator=g) * std
    return out


@torch.no_grad()
def golden_head_state_dict(spec: HeadSpec, draft_ids: torch.Tensor, token: int, *, seed: int = 0) -> dict:
    """A head that drafts ``token`` at every position when served with a marker target."""
    sd = random_head_state_dict(spec, seed=seed)
    sd["fc.weight"][MARKER] = 0.0
    sd["fc.weight"][MARKER, MARKER] = 1.0  # first aux state's marker -> the head's marker
    sd["mask_hidden"][..., MARKER] = 1.0
    for i in range(spec.num_layers):
        sd[f"layers.{i}.self_attn.o_proj.weight"][MARKER] = 0.0
        sd[f"layers.{i}.mlp.down_proj.weight"][MARKER] = 0.0
    sd["norm.weight"].zero_()
    sd["norm.weight"][MARKER] = 1.0
    draft_index = int((draft_ids == token).nonzero()[0, 0])
    sd["lm_head.weight"][:, MARKER] = -1.0
    sd["lm_head.weight"][draft_index, MARKER] = 1.0
    return sd


def draft_vocab_skipping_low_ids(vocab_size: int, draft_vocab_size: int, mask_token_id: int):
    """Draft ids that skip the lowest ids, so index != target id and only d2t recovers it."""
    odd = [t for t in range(1, vocab_size, 2) if t != mask_token_id]
    if len(odd) < draft_vocab_size - 1:
        raise ValueError(f"{vocab_size} ids have too few odd ones for a {draft_vocab_size}-token draft vocabulary")
    ids = sorted([*odd[: draft_vocab_size - 1], mask_token_id])
    draft_ids = torch.tensor(ids, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return {"draft_ids": draft_ids, "d2t": draft_ids - torch.arange(len(ids)), "t2d": t2d}


def tiny_target_facts(target_dir: str | Path, *, draft_vocab_size: int | None = None) -> TargetFacts:
    """The TargetFacts of a tiny target (vLLM's default aux layers, the <|mask|> token)."""
    from transformers import AutoConfig, AutoTokenizer

    from peagle.facts import default_aux_layer_ids

    tc = AutoConfig.from_pretrained(target_dir)
    return TargetFacts(
        target=str(target_dir),
        target_revision=None,
        target_num_layers=tc.num_hidden_layers,
        target_hidden_size=tc.hidden_size,
        vocab_size=tc.vocab_size,
        target_num_heads=tc.num_attention_heads,
        target_num_kv_heads=tc.num_key_value_heads,
        target_head_dim=None,
        target_intermediate_size=tc.intermediate_size,
        rms_norm_eps=tc.rms_norm_eps,
        rope_theta=float(tc.rope_parameters["rope_theta"]),
        rope_scaling=None,
        max_position_embeddings=tc.max_position_embeddings,
        aux_layer_ids=default_aux_layer_ids(tc.num_hidden_layers),
        final_layer_id=tc.num_hidden_layers,
        mask_token_id=AutoTokenizer.from_pretrained(target_dir).convert_tokens_to_ids(MASK_TOKEN),
        draft_vocab_size=draft_vocab_size,
    )


def tiny_head_spec(target_dir: str | Path, *, draft_vocab_size: int | None = None, num_layers: int = 2) -> HeadSpec:
    """The HeadSpec of a ``num_layers`` head as wide as a tiny target (``tiny_target_facts``)."""
    facts = tiny_target_facts(target_dir, draft_vocab_size=draft_vocab_size)
    shape = DrafterShape(
        hidden_size=facts.target_hidden_size,
        num_layers=num_layers,
        num_heads=facts.target_num_heads,
        num_kv_heads=facts.target_num_kv_heads,
        head_dim=facts.target_hidden_size // facts.target_num_heads,
        intermediate_size=facts.target_intermediate_size,
        rms_norm_eps=facts.rms_norm_eps,
        rope_theta=facts.rope_theta,
        rope_scaling=None,
        max_position_embeddings=facts.max_position_embeddings,
    )
    return head_spec(facts, shape)


def build_golden_pair(work_dir: str | Path, *, token: int = 101, draft_vocab_size: int = 128) -> tuple[Path, Path]:
    """Write a marker target and its golden head under ``work_dir``; returns (target, head)."""
    from peagle.export.head import export_head

    work_dir = Path(work_dir)
    target = build_tiny_target(work_dir / "target", constant_token=token)
    spec = tiny_head_spec(target, draft_vocab_size=draft_vocab_size)
    vocab = draft_vocab_skipping_low_ids(spec.vocab_size, draft_vocab_size, spec.mask_token_id)
    state = golden_head_state_dict(spec, vocab["draft_ids"], token)
    head = export_head(state, spec, vocab, work_dir / "head", target_path=target, overwrite=True)
    return target, head
