"""The facts every stage must agree on, each owned by what it describes.

- ``TargetFacts``: what the dataset was extracted from and for (the target's shape, its
  aux/final layer ids, the mask token, the draft vocabulary size). Derived once from the
  target's own config and the ``target``/``data`` sections, saved in the dataset directory
  (``target_facts.json``); the data stage's cache key covers exactly these inputs.
- ``DrafterShape``: the drafter's architecture, derived from ``cfg.drafter`` and the target
  facts when training starts (never cached with the data, so a changed ``drafter`` section
  always trains the new shape).
- ``HeadSpec``: a trained head = target facts + drafter shape + method + k_train. Saved in
  every checkpoint (``head_spec.json``); offline evaluation, export, the model card and the
  drafter's loader read it from there.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from peagle.catalogue import describe
from peagle.config import KV_PER_QUERY_HEAD, ConfigError, PipelineConfig
from peagle.fileio import write_json_atomic

FACTS_VERSION = 1
HEAD_SPEC_VERSION = 1  # head_spec.json, in every checkpoint


def text_config(config):
    """The language model's part of a target's config, whose fields peagle reads (a multimodal
    config nests it under ``text_config``): a ``transformers`` config or its config.json dict."""
    if isinstance(config, dict):
        return config.get("text_config") or config
    if hasattr(config, "get_text_config"):
        return config.get_text_config()
    return getattr(config, "text_config", None) or config


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default EAGLE-3 feature layers for an L-layer target: (2, L//2, L-3)."""
    ids = [2, num_layers // 2, num_layers - 3]
    if sorted(set(ids)) != ids:
        raise ConfigError(
            f"a {num_layers}-layer target has no distinct default aux layers {ids}; "
            "set data.aux_layer_ids explicitly"
        )
    return ids


def _write_json(path: Path, data: dict) -> None:
    """Durable and atomic: a reader never sees half a file."""
    write_json_atomic(path, data, indent=2, sort_keys=True)


def _read_json(path: Path, what: str) -> dict:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: no {what} there")
    return json.loads(path.read_text())


# ----------------------------------------------------------------------------- the target (dataset)


@dataclass(frozen=True)
class TargetFacts:
    """The target a dataset holds hidden states of; field names match ``HeadSpec``'s."""

    target: str
    target_revision: str | None
    target_num_layers: int
    target_hidden_size: int  # Ht
    vocab_size: int  # V, the target's
    target_num_heads: int
    target_num_kv_heads: int
    target_head_dim: int | None  # the config's explicit head_dim, if any
    target_intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    aux_layer_ids: list[int]  # ascending; each id = residual stream after that many layers
    final_layer_id: int  # = target_num_layers: pre-norm last hidden state, for target logits
    mask_token_id: int
    draft_vocab_size: int | None = None  # Vd; set once the draft vocabulary is built
    version: int = FACTS_VERSION

    @property
    def stored_layer_ids(self) -> list[int]:
        """Layers the dataset stores per token: the three aux layers, then the final one."""
        return [*self.aux_layer_ids, self.final_layer_id]

    def with_draft_vocab(self, draft_vocab_size: int) -> TargetFacts:
        if not 2 <= draft_vocab_size <= self.vocab_size:
            raise ConfigError(
                f"data.draft_vocab_size={draft_vocab_size} must be in [2, {self.vocab_size}] "
                "(the target vocabulary size)"
            )
        return replace(self, draft_vocab_size=draft_vocab_size)

    def save(self, path: Path) -> None:
        _write_json(path, asdict(self))

    @classmethod
    def load(cls, path: Path) -> TargetFacts:
        data = _read_json(path, "dataset (target facts)")
        if data.get("version") != FACTS_VERSION:
            raise ValueError(f"{path}: target facts version {data.get('version')} is not {FACTS_VERSION}; "
                             "rebuild the dataset with this peagle (`peagle data CONFIG --force`)")
        return cls(**data)


def load_dataset_facts(layout) -> TargetFacts:
    """The target facts of a dataset directory (a ``peagle.layout.DataLayout``), checked."""
    if layout.facts.exists():
        return TargetFacts.load(layout.facts)
    raise FileNotFoundError(f"{layout.facts} not found: build the dataset first (`peagle data CONFIG`)")


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


def _rope(tc) -> tuple[float, dict | None]:
    """(rope_theta, scaling) from either transformers config style (rope_theta or rope_parameters)."""
    rope_theta = getattr(tc, "rope_theta", None)
    rope_scaling = getattr(tc, "rope_scaling", None)
    rope_params = getattr(tc, "rope_parameters", None)
    if rope_theta is None and isinstance(rope_params, dict):
        rope_theta = rope_params.get("rope_theta")
        if rope_params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    return float(rope_theta or 10000.0), rope_scaling


def target_facts_from_target(cfg: PipelineConfig, target_config, tokenizer) -> TargetFacts:
    """Check the ``target``/``data`` config against the target and derive its facts.

    ``target_config`` is the target's ``transformers`` config (text part for multimodal
    models); ``tokenizer`` its tokenizer. Raises ``ConfigError`` naming the key to fix.
    """
    tc = text_config(target_config)
    num_layers = int(tc.num_hidden_layers)
    vocab = int(tc.vocab_size)
    aux = list(cfg.data.aux_layer_ids) if cfg.data.aux_layer_ids else default_aux_layer_ids(num_layers)
    if aux[-1] >= num_layers:
        raise ConfigError(
            f"data.aux_layer_ids {aux}: layer {aux[-1]} is beyond the target's depth "
            f"({num_layers} layers; ids must be < {num_layers})"
        )
    heads = int(tc.num_attention_heads)
    rope_theta, rope_scaling = _rope(tc)
    return TargetFacts(
        target=cfg.target.model,
        target_revision=cfg.target.revision,
        target_num_layers=num_layers,
        target_hidden_size=int(tc.hidden_size),
        vocab_size=vocab,
        target_num_heads=heads,
        target_num_kv_heads=int(getattr(tc, "num_key_value_heads", None) or heads),
        target_head_dim=int(tc.head_dim) if getattr(tc, "head_dim", None) else None,
        target_intermediate_size=int(tc.intermediate_size),
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(getattr(tc, "max_position_embeddings", 2048)),
        aux_layer_ids=aux,
        final_layer_id=num_layers,
        mask_token_id=_resolve_mask_token_id(cfg, tokenizer, vocab),
    )


# ----------------------------------------------------------------------------- the drafter (checkpoint)


@dataclass(frozen=True)
class DrafterShape:
    """The drafter's architecture: ``cfg.drafter`` resolved against the target."""

    hidden_size: int  # H
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int


def drafter_shape(cfg: PipelineConfig, facts: TargetFacts) -> DrafterShape:
    """The drafter of ``cfg.drafter`` for this target: the target's own widths where unset, and
    the depth of ``train.method`` (``MethodDescription.num_layers``: EAGLE-3 may have its own).

    Raises ``ConfigError`` naming the key for shapes that cannot work.
    """
    d, ht = cfg.drafter, facts.target_hidden_size
    hidden = d.hidden_size or ht
    same_width = hidden == ht
    heads = d.num_heads or (facts.target_num_heads if same_width else max(1, hidden // 64))
    if d.num_kv_heads == KV_PER_QUERY_HEAD:
        kv_heads = heads
    else:
        kv_heads = d.num_kv_heads or (facts.target_num_kv_heads if same_width else heads)
    if hidden % heads or heads % kv_heads:
        raise ConfigError(
            f"drafter: hidden_size {hidden} must divide by num_heads {heads}, "
            f"and num_heads by num_kv_heads {kv_heads}"
        )
    head_dim = facts.target_head_dim if same_width and facts.target_head_dim else hidden // heads
    if cfg.train.recipe.max_len + cfg.train.peagle.k_train > facts.max_position_embeddings:
        raise ConfigError(
            f"train.recipe.max_len + train.peagle.k_train ({cfg.train.recipe.max_len + cfg.train.peagle.k_train}) exceeds the "
            f"target's max_position_embeddings ({facts.max_position_embeddings})"
        )
    return DrafterShape(
        hidden_size=hidden,
        num_layers=describe(cfg.train.method).num_layers(cfg),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=d.intermediate_size or (facts.target_intermediate_size if same_width else 4 * hidden),
        rms_norm_eps=facts.rms_norm_eps,
        rope_theta=facts.rope_theta,
        rope_scaling=facts.rope_scaling,
        max_position_embeddings=facts.max_position_embeddings,
    )


# ----------------------------------------------------------------------------- a trained head


@dataclass(frozen=True)
class HeadSpec:
    """Everything about a head fixed when its training starts; lives in every checkpoint."""

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
    method: str | None = None  # train.method it was trained with (None: not a trained head)
    k_train: int | None = None  # train.peagle.k_train it was trained with
    # train.peagle.mask_slot_inputs it was trained with: anything but "mask" is a measurement, not servable
    mask_slot_inputs: str = "mask"

    @property
    def as_wide_as_target(self) -> bool:
        """The drafter's width is the target's: its embeddings, lm_head and norm start as the target's."""
        return self.hidden_size == self.target_hidden_size

    @property
    def stored_layer_ids(self) -> list[int]:
        """Layers the dataset stores per token: the three aux layers, then the final one."""
        return [*self.aux_layer_ids, self.final_layer_id]

    @property
    def shape(self) -> DrafterShape:
        return DrafterShape(**{f.name: getattr(self, f.name) for f in fields(DrafterShape)})

    def with_draft_vocab(self, draft_vocab_size: int) -> HeadSpec:
        if not 2 <= draft_vocab_size <= self.vocab_size:
            raise ConfigError(
                f"data.draft_vocab_size={draft_vocab_size} must be in [2, {self.vocab_size}] "
                "(the target vocabulary size)"
            )
        return replace(self, draft_vocab_size=draft_vocab_size)

    def same_target_as(self, facts: TargetFacts) -> bool:
        """Whether this head was trained on hidden states of ``facts``'s target, layers and vocabulary."""
        return all(getattr(self, name) == getattr(facts, name) for name in _SHARED_TARGET_FIELDS)

    def to_json(self) -> str:
        return json.dumps({"version": HEAD_SPEC_VERSION, **asdict(self)}, indent=2, sort_keys=True)

    def save(self, path: Path) -> None:
        _write_json(path, {"version": HEAD_SPEC_VERSION, **asdict(self)})

    @classmethod
    def load(cls, path: Path) -> HeadSpec:
        data = _read_json(path, "trained head's spec (a checkpoint directory holds head_spec.json)")
        version = data.pop("version", None)
        if version != HEAD_SPEC_VERSION:
            raise ValueError(f"{path}: head spec version {version} is not {HEAD_SPEC_VERSION}: the checkpoint was "
                             "written by another peagle; train the head again (a new workdir, or delete the checkpoint)")
        return cls(**data)


_SHARED_TARGET_FIELDS = ("target", "target_revision", "target_num_layers", "target_hidden_size", "vocab_size",
                         "aux_layer_ids", "final_layer_id", "mask_token_id", "draft_vocab_size")


def head_spec(facts: TargetFacts, shape: DrafterShape, method: str | None = None,
              k_train: int | None = None, mask_slot_inputs: str = "mask") -> HeadSpec:
    """A head of ``shape`` drafting for the target of ``facts``."""
    shared = {name: getattr(facts, name) for name in _SHARED_TARGET_FIELDS}
    return HeadSpec(**shared, **asdict(shape), method=method, k_train=k_train, mask_slot_inputs=mask_slot_inputs)


def head_spec_for(cfg: PipelineConfig, facts: TargetFacts) -> HeadSpec:
    """The head ``cfg`` trains on a dataset of ``facts``: derived when training starts."""
    return head_spec(facts, drafter_shape(cfg, facts), cfg.train.method, cfg.train.peagle.k_train,
                     cfg.train.peagle.mask_slot_inputs)
