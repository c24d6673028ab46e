"""The head's model card (README.md): what it drafts for, where it came from, how to serve it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from peagle.export.contract import draft_vocab_size, speculative_config
from peagle.facts import HeadSpec
from peagle.methods import DEFAULT_METHOD, DraftingMethod, get_method


@dataclass
class ModelCardInfo:
    """What the exporter cannot know from the weights: names, lineage and measured acceptance.

    ``target_ref`` is what users pass to ``vllm serve`` (a hub id or a path; default
    ``spec.target``); ``head_ref`` is what goes under ``"model"`` in the speculative config
    (a hub id; default the exported directory). ``acceptance`` maps K to the acceptance
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
    recommended_k: int | None = None
    license: str = "apache-2.0"
    notes: str = ""
    method: str = DEFAULT_METHOD  # the drafting method's name (peagle.methods): text, tags, serve line

    @property
    def drafting(self) -> DraftingMethod:
        return get_method(self.method)


def serve_command(target_ref: str, head_ref: str, k: int, parallel_drafting: bool = True) -> str:
    """The one line a user runs: ``vllm serve <target> --speculative-config '<json>'``."""
    spec = speculative_config(head_ref, k, parallel_drafting=parallel_drafting)
    return f"vllm serve {target_ref} --speculative-config '{json.dumps(spec)}'"


def recommended_k(info: ModelCardInfo) -> int:
    """The K to advertise: the caller's, else the measured best, else 5 (the paper's serving K)."""
    if info.recommended_k:
        return info.recommended_k
    if info.acceptance:
        return max(info.acceptance, key=lambda k: (info.acceptance[k], -k))
    return 5


def _front_matter(info: ModelCardInfo, target_ref: str) -> str:
    lines = ["---", f"license: {info.license}", f"base_model: {target_ref}", "library_name: vllm", "tags:"]
    lines += [f"  - {t}" for t in info.drafting.card_tags]
    return "\n".join([*lines, "---"])


def _key_values(title: str, values: dict[str, str]) -> list[str]:
    if not values:
        return [f"## {title}", "", "Not recorded.", ""]
    return [f"## {title}", "", *[f"- **{k}**: {v}" for k, v in values.items()], ""]


def _acceptance_table(info: ModelCardInfo) -> list[str]:
    lines = ["## Acceptance length", ""]
    if not info.acceptance:
        return [*lines, "Not measured yet (run `peagle eval` and re-export).", ""]
    ks = sorted(set(info.acceptance) | set(info.baseline_acceptance))
    with_base = bool(info.baseline_acceptance)
    header = f"| K | {info.drafting.display_name} |" + (f" {info.baseline_label or 'baseline'} |" if with_base else "")
    rule = "|---|---|" + ("---|" if with_base else "")
    lines += [header, rule]
    for k in ks:
        row = f"| {k} | {_fmt(info.acceptance.get(k))} |"
        lines.append(row + (f" {_fmt(info.baseline_acceptance.get(k))} |" if with_base else ""))
    if info.acceptance_source:
        lines += ["", info.acceptance_source]
    return [*lines, ""]


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def render_model_card(info: ModelCardInfo, spec: HeadSpec, default_head_ref: str) -> str:
    """README.md text for the head; every number comes from ``info`` or ``spec``."""
    target_ref = info.target_ref or spec.target
    head_ref = info.head_ref or default_head_ref
    k = recommended_k(info)
    method = info.drafting
    title = info.name or f"{method.display_name} head for {target_ref}"
    architecture = {
        "target": f"{target_ref}" + (f" (revision {spec.target_revision})" if spec.target_revision else ""),
        "drafter": f"{spec.num_layers} Llama decoder layers, hidden {spec.hidden_size}, "
        f"{spec.num_heads} heads ({spec.num_kv_heads} KV), intermediate {spec.intermediate_size}",
        "target features": f"aux layers {sorted(spec.aux_layer_ids)} of {spec.target_num_layers} "
        f"(hidden {spec.target_hidden_size})",
        "vocabulary": f"draft {draft_vocab_size(spec)} of target {spec.vocab_size}",
        "mask token id": str(spec.mask_token_id),
    }
    lines = [
        _front_matter(info, target_ref),
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
        method.card_serve_note,
        "",
        *_key_values("Architecture", architecture),
        *_key_values("Training data", info.data_lineage),
        *_key_values("Training", info.training),
        *_acceptance_table(info),
    ]
    if info.notes:
        lines += ["## Notes", "", info.notes, ""]
    return "\n".join(lines)
