"""The facts every stage must agree on, computed in exactly one place.

Aux layer ids, the mask token id, the final layer used for target distributions, the
target's shape and the drafter's shape are derived here from the target's own config
and the pipeline config. Data extraction, training, evaluation and export all read a
``HeadSpec`` (persisted as JSON beside the dataset) instead of recomputing them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from peagle.config import ConfigError, PipelineConfig


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default EAGLE-3 feature layers for an L-layer target: (2, L//2, L-3)."""
    ids = [2, num_layers // 2, num_layers - 3]
    if sorted(set(ids)) != ids:
        raise ConfigError(
            f"a {num_layers}-layer target has no distinct default aux layers {ids}; "
            "set data.aux_layer_ids explicitly"
        )
    return ids


@dataclass(frozen=True)
class HeadSpec:
    """Everything about a head that is fixed before training starts."""

    target: str
    target_revision: str | None
    target_num_layers: int
    target_hidden_size: int  # Ht
    vocab_size: int  # V, the target's
    aux_layer_ids: list[int]  # ascending; each id = residual stream after that many layers
    final_layer_id: int  # = target_num_layers: pre-norm last hidden state, for target logits
    mask_token_id: int
    hidden_size: int  # H, the drafter's
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    draft_vocab_size: int | None = None  # Vd; set once the draft vocabulary is built
    extra: dict = field(default_factory=dict)

    @property
    def stored_layer_ids(self) -> list[int]:
        """Layers the dataset stores per token: the three aux layers, then the final one."""
        return [*self.aux_layer_ids, self.final_layer_id]

    def with_draft_vocab(self, draft_vocab_size: int) -> HeadSpec:
        if not 2 <= draft_vocab_size <= self.vocab_size:
            raise ConfigError(
                f"data.draft_vocab_size={draft_vocab_size} must be in [2, {self.vocab_size}] "
                "(the target vocabulary size)"
            )
        return HeadSpec(**{**asdict(self), "draft_vocab_size": draft_vocab_size})

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> HeadSpec:
        return cls(**json.loads(Path(path).read_text()))


def _resolve_mask_token_id(cfg: PipelineConfig, tokenizer, vocab_size: int) -> int:
    t = cfg.target
    if t.mask_token_id is not None:
        token_id = t.mask_token_id
    else:
        token_id = tokenizer.convert_tokens_to_ids(t.mask_token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ConfigError(
                f"target.mask_token {t.mask_token!r} is not a token of {t.model}; "
                "set target.mask_token to a reserved/unused token string or target.mask_token_id "
                "to an unused id"
            )
    if not 0 <= token_id < vocab_size:
        raise ConfigError(f"target.mask_token_id={token_id} is outside the vocabulary [0, {vocab_size})")
    return int(token_id)


def head_spec_from_target(cfg: PipelineConfig, target_config, tokenizer) -> HeadSpec:
    """Check the config against the target and derive the head's shape.

    ``target_config`` is the target's ``transformers`` config (text part for multimodal
    models); ``tokenizer`` its tokenizer. Raises ``ConfigError`` naming the key to fix.
    """
    tc = getattr(target_config, "text_config", None) or target_config
    num_layers = int(tc.num_hidden_layers)
    ht = int(tc.hidden_size)
    vocab = int(tc.vocab_size)
    aux = list(cfg.data.aux_layer_ids) if cfg.data.aux_layer_ids else default_aux_layer_ids(num_layers)
    if aux[-1] >= num_layers:
        raise ConfigError(
            f"data.aux_layer_ids {aux}: layer {aux[-1]} is beyond the target's depth "
            f"({num_layers} layers; ids must be < {num_layers})"
        )
    d = cfg.drafter
    hidden = d.hidden_size or ht
    heads = d.num_heads or (int(tc.num_attention_heads) if hidden == ht else max(1, hidden // 64))
    kv_heads = d.num_kv_heads or (int(getattr(tc, "num_key_value_heads", heads)) if hidden == ht else heads)
    if hidden % heads or heads % kv_heads:
        raise ConfigError(
            f"drafter: hidden_size {hidden} must divide by num_heads {heads}, "
            f"and num_heads by num_kv_heads {kv_heads}"
        )
    head_dim = hidden // heads
    if hidden == ht and getattr(tc, "head_dim", None):
        head_dim = int(tc.head_dim)
    inter = d.intermediate_size or (int(tc.intermediate_size) if hidden == ht else 4 * hidden)
    rope_theta = getattr(tc, "rope_theta", None)
    rope_scaling = getattr(tc, "rope_scaling", None)
    rope_params = getattr(tc, "rope_parameters", None)
    if rope_theta is None and isinstance(rope_params, dict):
        rope_theta = rope_params.get("rope_theta")
        if rope_params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    max_pos = int(getattr(tc, "max_position_embeddings", 2048))
    if cfg.train.max_len + cfg.train.k_train > max_pos:
        raise ConfigError(
            f"train.max_len + train.k_train ({cfg.train.max_len + cfg.train.k_train}) exceeds the "
            f"target's max_position_embeddings ({max_pos})"
        )
    return HeadSpec(
        target=cfg.target.model,
        target_revision=cfg.target.revision,
        target_num_layers=num_layers,
        target_hidden_size=ht,
        vocab_size=vocab,
        aux_layer_ids=aux,
        final_layer_id=num_layers,
        mask_token_id=_resolve_mask_token_id(cfg, tokenizer, vocab),
        hidden_size=hidden,
        num_layers=d.num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=inter,
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-5)),
        rope_theta=float(rope_theta or 10000.0),
        rope_scaling=rope_scaling,
        max_position_embeddings=max_pos,
    )
