"""Prove a head directory is what vLLM loads, before anyone publishes it.

vLLM's ``load_weights`` does not complain about missing weights: a misnamed tensor loads
silently as zeros or random values, and an ``embed_tokens`` equal to the target's is
replaced by the target's table (losing the learned mask row). So the checks here are
strict and static first (names, shapes, dtypes, config consistency, vocabulary maps,
mask row), then optional: serve the head in vLLM with its target and see drafts made.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from peagle.catalogue import DEFAULT_METHOD, MethodDescription, describe
from peagle.contract import (
    ACCEPTED_ARCHITECTURES,
    CARD_FILE,
    CONFIG_FILE,
    MASK_HIDDEN,
    WEIGHTS_FILE,
    TensorRule,
    check_head_dtype,
    expected_tensors,
    speculative_config,
)
from peagle.facts import HeadSpec
from peagle.methods import get_method
from peagle.model.target_weights import read_target_tensor, target_config

log = logging.getLogger(__name__)

REQUIRED_CONFIG_KEYS = (
    "architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "intermediate_size", "rms_norm_eps", "max_position_embeddings",
    "vocab_size", "draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids",
)  # fmt: skip


@dataclass(frozen=True)
class Problem:
    what: str
    fix: str

    def __str__(self) -> str:
        return f"{self.what}\n    fix: {self.fix}"


@dataclass
class VllmCheck:
    """What vLLM did with the head: its start-up time and the drafts it made."""

    num_speculative_tokens: int
    parallel_drafting: bool
    engine_start_s: float
    generate_s: float
    output_tokens: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    acceptance_length: float | None
    per_position_acceptance: list[float]


@dataclass
class ValidationReport:
    head_dir: Path
    problems: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    vllm: VllmCheck | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def problem(self, what: str, fix: str) -> None:
        self.problems.append(Problem(what, fix))

    def raise_if_failed(self) -> None:
        if self.problems:
            raise HeadValidationError(self.head_dir, self.problems)


class HeadValidationError(ValueError):
    """A head vLLM would reject or load wrongly; lists every problem with its fix."""

    def __init__(self, head_dir: Path, problems: list[Problem]):
        self.head_dir = head_dir
        self.problems = list(problems)
        listing = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{head_dir}: {len(self.problems)} problem(s) with this vLLM head:\n{listing}")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a head's float tensors named ``name`` (config.json's ``torch_dtype``)."""
    return getattr(torch, check_head_dtype(name))


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, as config.json names it."""
    return str(dtype).removeprefix("torch.")


@dataclass
class CheckedTarget:
    """The parts of the target a head must agree with; ``embed`` only when available."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    embed: torch.Tensor | None = None
    source: str = ""


# ---------------------------------------------------------------- the target side


def load_target_embedding(target_dir: Path) -> torch.Tensor | None:
    """The target's input embedding table, read from its safetensors without loading the rest."""
    return read_target_tensor(target_dir, "embed_tokens.weight")


def read_target(target_path: str | Path, *, revision: str | None = None, with_embed: bool = True) -> CheckedTarget:
    """Vocabulary, widths and depth of the target (a local directory or a cached hub id)."""
    target_dir = Path(target_path)
    if not target_dir.is_dir():
        from huggingface_hub import snapshot_download

        try:
            target_dir = Path(
                snapshot_download(str(target_path), revision=revision, allow_patterns=["*.json", "*.safetensors"])
            )
        except Exception as err:  # offline, unknown repo, ...
            raise FileNotFoundError(
                f"target {target_path!r} is not a local directory and could not be fetched ({err}); "
                "pass the local path of the target model"
            ) from None
    config_file = target_dir / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{target_dir}: no config.json; pass the target model's directory")
    tc = target_config(target_dir)
    return CheckedTarget(
        vocab_size=int(tc["vocab_size"]),
        hidden_size=int(tc["hidden_size"]),
        num_layers=int(tc["num_hidden_layers"]),
        embed=load_target_embedding(target_dir) if with_embed else None,
        source=str(target_dir),
    )


def checked_target_from_spec(spec: HeadSpec) -> CheckedTarget:
    return CheckedTarget(spec.vocab_size, spec.target_hidden_size, spec.target_num_layers, None, "head spec")


def checked_target_from_head(head_dir: str | Path) -> CheckedTarget:
    """The target as the head's own ``config.json`` describes it (vocabulary, width, at least its
    deepest aux layer), to check a head away from its target: every static check but those against
    the target's own table and depth. A config.json that cannot say gives an empty target, and
    ``static_check`` reports the config's problem."""
    try:
        config = json.loads((Path(head_dir) / CONFIG_FILE).read_text())
        return CheckedTarget(int(config["vocab_size"]), int(config["target_hidden_size"]),
                             max(int(i) for i in config["eagle_aux_hidden_state_layer_ids"]), None, "the head's config.json")
    except (OSError, ValueError, KeyError, TypeError):
        return CheckedTarget(0, 0, 0, None, "no readable config.json")


# ---------------------------------------------------------------- static checks


def _load_config(report: ValidationReport) -> dict | None:
    path = report.head_dir / CONFIG_FILE
    if not path.exists():
        report.problem(f"{CONFIG_FILE} is missing", "export the head with peagle.export.head.export_head")
        return None
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        report.problem(f"{CONFIG_FILE} is not valid JSON ({err})", "re-export the head")
        return None
    missing = [k for k in REQUIRED_CONFIG_KEYS if k not in config]
    if missing:
        report.problem(f"{CONFIG_FILE} lacks {missing}", "re-export the head; vLLM reads every one of these keys")
        return None
    return config


def _check_config(report: ValidationReport, config: dict, target: CheckedTarget, parallel_drafting: bool) -> None:
    archs = config.get("architectures") or []
    if not archs or archs[0] not in ACCEPTED_ARCHITECTURES:
        report.problem(
            f"architectures is {archs}, which vLLM does not map to its EAGLE-3 Llama drafter",
            'set "architectures": ["LlamaForCausalLMEagle3"]',
        )
    if config.get("model_type") != "llama":
        report.problem(f"model_type is {config.get('model_type')!r}", 'set "model_type": "llama"')
    if config.get("tie_word_embeddings", True) is not False:
        report.problem(
            "tie_word_embeddings is not false: lm_head would be tied to embed_tokens",
            'set "tie_word_embeddings": false',
        )
    if config["vocab_size"] != target.vocab_size:
        report.problem(
            f"vocab_size {config['vocab_size']} differs from the target's {target.vocab_size} ({target.source})",
            "vocab_size must be the TARGET's vocabulary size; draft_vocab_size holds Vd",
        )
    if not 2 <= config["draft_vocab_size"] <= config["vocab_size"]:
        report.problem(
            f"draft_vocab_size {config['draft_vocab_size']} is outside [2, vocab_size={config['vocab_size']}]",
            "set draft_vocab_size to the number of rows of lm_head.weight",
        )
    if config["target_hidden_size"] != target.hidden_size:
        report.problem(
            f"target_hidden_size {config['target_hidden_size']} differs from the target's hidden size "
            f"{target.hidden_size}",
            "set target_hidden_size to the target's hidden_size (fc takes 3 x that)",
        )
    ids = config["eagle_aux_hidden_state_layer_ids"]
    if not isinstance(ids, list) or len(ids) != 3 or ids != sorted(set(ids)):
        report.problem(
            f"eagle_aux_hidden_state_layer_ids {ids} is not 3 strictly ascending ids",
            "list the three target layer ids the head was trained on, ascending",
        )
    elif ids[0] < 1 or ids[-1] > target.num_layers:
        report.problem(
            f"eagle_aux_hidden_state_layer_ids {ids} fall outside the target's layers 1..{target.num_layers}",
            "use the layer ids of the dataset's target_facts.json",
        )
    dtype_names = {config.get("torch_dtype"), config.get("dtype")} - {None}
    if len(dtype_names) > 1:
        report.problem(
            f"torch_dtype and dtype disagree ({sorted(dtype_names)}); transformers 5 reads dtype",
            "write the same dtype under both keys",
        )
    _check_mask_ids(report, config, parallel_drafting)
    report.checks.append("config")


def _check_mask_ids(report: ValidationReport, config: dict, parallel_drafting: bool) -> None:
    names = ("mask_token_id", "ptd_token_id")
    ids = {n: config.get(n) for n in names if config.get(n) is not None}
    if not ids:
        if parallel_drafting:
            report.problem(
                "no mask token id in config.json: vLLM cannot build the parallel-drafting slots",
                "write the mask token id under both mask_token_id and ptd_token_id",
            )
        return
    if len(set(ids.values())) > 1:
        report.problem(f"mask token ids disagree: {ids}", "write the same id under mask_token_id and ptd_token_id")
    for name, value in ids.items():
        if not isinstance(value, int) or not 0 <= value < config["vocab_size"]:
            report.problem(
                f"{name}={value!r} is not a token id in [0, {config['vocab_size']})", "use the target's mask token id"
            )
    if parallel_drafting and len(ids) < len(names):
        report.warnings.append(f"mask id only under {sorted(ids)}; write both {names} to serve every vLLM version")


def spec_from_config(config: dict, target: CheckedTarget) -> HeadSpec:
    """The HeadSpec a head's config.json describes (to derive the tensors it must hold)."""
    heads = int(config["num_attention_heads"])
    return HeadSpec(
        target=target.source,
        target_revision=None,
        target_num_layers=target.num_layers,
        target_hidden_size=int(config["target_hidden_size"]),
        vocab_size=int(config["vocab_size"]),
        aux_layer_ids=list(config["eagle_aux_hidden_state_layer_ids"]),
        final_layer_id=target.num_layers,
        mask_token_id=int(config.get("mask_token_id", config.get("ptd_token_id", 0))),
        hidden_size=int(config["hidden_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config["num_key_value_heads"]),
        head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
        intermediate_size=int(config["intermediate_size"]),
        rms_norm_eps=float(config["rms_norm_eps"]),
        rope_theta=float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 1e4)),
        rope_scaling=config.get("rope_scaling"),
        max_position_embeddings=int(config["max_position_embeddings"]),
        draft_vocab_size=int(config["draft_vocab_size"]),
    )


def _rename_hint(name: str, expected: set[str]) -> str:
    if name.startswith("model.") and name[len("model.") :] in expected:
        return f"drop the 'model.' prefix ({name} -> {name[len('model.'):]})"
    if name.startswith("midlayer."):
        return "vLLM maps midlayer.* to layers.0.*; write layers.0.* names"
    if name == "draft_id_to_target_id" or name.endswith("d2t"):
        return "the offsets tensor is named d2t and ships only when draft_vocab_size < vocab_size"
    close = [e for e in expected if e.split(".")[-2:] == name.split(".")[-2:]]
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"remove it or rename it to a name vLLM loads{hint}; vLLM fails on unknown names"


def _normalise(name: str) -> str:
    return "layers.0." + name[len("midlayer.") :] if name.startswith("midlayer.") else name


def _read_tensors(report: ValidationReport) -> dict[str, torch.Tensor] | None:
    path = report.head_dir / WEIGHTS_FILE
    if not path.exists():
        others = sorted(p.name for p in report.head_dir.glob("*.safetensors"))
        report.problem(f"{WEIGHTS_FILE} is missing (found {others or 'no safetensors'})", "export with export_head")
        return None
    try:
        with safe_open(str(path), "pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except Exception as err:
        report.problem(f"{WEIGHTS_FILE} cannot be read ({err})", "re-export the head")
        return None


def _kind_ok(tensor: torch.Tensor, rule: TensorRule, float_dtype: torch.dtype | None) -> bool:
    if rule.kind == "int64":
        return tensor.dtype == torch.int64
    if rule.kind == "bool":
        return tensor.dtype == torch.bool
    return tensor.is_floating_point() and (float_dtype is None or tensor.dtype == float_dtype)


def _check_names_shapes_dtypes(
    report: ValidationReport, tensors: dict[str, torch.Tensor], rules: dict[str, TensorRule], float_dtype
) -> None:
    names = {_normalise(n): n for n in tensors}
    expected = set(rules)
    for name in sorted(expected - set(names)):
        report.problem(
            f"tensor {name} is missing ({rules[name].why or 'vLLM would leave it at its initial values'})",
            f"ship {name} with shape {list(rules[name].shape)}",
        )
    for name in sorted(set(names) - expected):
        report.problem(f"unexpected tensor {names[name]}", _rename_hint(names[name], expected))
    for name in sorted(expected & set(names)):
        tensor, rule = tensors[names[name]], rules[name]
        shape_ok = tuple(tensor.shape) == rule.shape
        if name == MASK_HIDDEN:  # vLLM views it as [1, 3Ht]; any shape of that size loads
            shape_ok = tensor.numel() == rule.shape[-1]
        if not shape_ok:
            report.problem(
                f"{name} has shape {list(tensor.shape)}, expected {list(rule.shape)}",
                "check hidden_size / target_hidden_size / draft_vocab_size / heads in config.json "
                "against the weights",
            )
        if not _kind_ok(tensor, rule, float_dtype):
            want = {"int64": "torch.int64", "bool": "torch.bool"}.get(rule.kind, str(float_dtype or "a float"))
            report.problem(f"{name} has dtype {tensor.dtype}, expected {want}", "cast it at export (torch_dtype)")
        elif tensor.is_floating_point() and not torch.isfinite(tensor).all():
            report.problem(f"{name} holds NaN or inf values", "export a checkpoint from before training diverged")
    report.checks.append("tensor names, shapes and dtypes")


def _check_vocab_maps(report: ValidationReport, tensors: dict[str, torch.Tensor], config: dict) -> None:
    vocab, vd = config["vocab_size"], config["draft_vocab_size"]
    t2d = tensors.get("t2d")
    if t2d is None or t2d.dtype != torch.bool or t2d.shape != (vocab,):
        return  # reported by the shape check
    if "d2t" not in tensors:
        if vd == vocab and not t2d.all():
            report.problem("t2d marks tokens outside the draft vocabulary although Vd == V", "ship t2d all true")
        return
    d2t = tensors["d2t"]
    if d2t.dtype != torch.int64 or d2t.shape != (vd,):
        return
    targets = torch.arange(vd) + d2t
    if targets.min() < 0 or targets.max() >= vocab:
        bad = int(((targets < 0) | (targets >= vocab)).sum())
        report.problem(
            f"d2t maps {bad} draft ids outside [0, {vocab}) (target_id = i + d2t[i])",
            "d2t holds OFFSETS: d2t[i] = draft_ids[i] - i, not the target ids themselves",
        )
        return
    if vd > 1 and not (targets[1:] > targets[:-1]).all():
        report.problem(
            "d2t does not map draft ids to strictly increasing target ids",
            "order the draft vocabulary by ascending target id and recompute d2t = draft_ids - arange(Vd)",
        )
    if int(t2d.sum()) != vd or not t2d[targets.clamp(0, vocab - 1)].all():
        if d2t.min() >= 0 and d2t.max() < vocab and bool(t2d[d2t].all()):
            report.problem(
                "d2t holds the draft vocabulary's target ids, but vLLM adds them to the draft index",
                "d2t holds OFFSETS: d2t[i] = draft_ids[i] - i, not the target ids themselves",
            )
        else:
            report.problem(
                "t2d and d2t disagree on which target ids are in the draft vocabulary", "rebuild both from draft_ids"
            )
    report.checks.append("d2t / t2d")


def _equal_in(a: torch.Tensor, b: torch.Tensor, dtypes: set[torch.dtype]) -> bool:
    """Bitwise equal after casting both to any of ``dtypes`` (what vLLM may load them as).

    vLLM compares the tables after loading, in the serving dtype: on CPU ``dtype=auto``
    turns a float32 checkpoint into bfloat16, so rows that differ only below bfloat16's
    precision count as equal there.
    """
    return any(torch.equal(a.to(d), b.to(d)) for d in dtypes)


def _check_mask_row(report: ValidationReport, tensors: dict, config: dict, target: CheckedTarget) -> None:
    embed = tensors.get("embed_tokens.weight")
    mask_id = config.get("mask_token_id", config.get("ptd_token_id"))
    if embed is None or mask_id is None or not 0 <= mask_id < embed.shape[0]:
        return
    row = embed[mask_id]
    if not row.any():
        report.problem(f"embed_tokens row {mask_id} (the mask token) is all zeros", "export a trained head")
    mask_hidden = tensors.get(MASK_HIDDEN)
    if mask_hidden is not None and mask_hidden.is_floating_point() and not mask_hidden.any():
        report.problem("mask_hidden is all zeros (never trained or lost at export)", "export the trained mask_hidden")
    if target.embed is None:
        report.warnings.append("target embedding not available: mask row not compared with the target's")
        return
    if tuple(target.embed.shape) != tuple(embed.shape):
        report.warnings.append(
            f"head embed_tokens {list(embed.shape)} and target's {list(target.embed.shape)} differ in shape: "
            "vLLM keeps the head's own table"
        )
        return
    dtypes = {embed.dtype, target.embed.dtype, torch.bfloat16}
    if _equal_in(embed, target.embed, dtypes):
        report.problem(
            "embed_tokens is bitwise equal to the target's table: vLLM will share the target's and the "
            "learned mask row is lost",
            "train with embeddings unfrozen (at least the mask row) and export the trained table",
        )
    elif _equal_in(row, target.embed[mask_id], dtypes):
        report.problem(
            f"the mask token's embed row ({mask_id}) equals the target's row: it was never learned",
            "train the mask row (P-EAGLE learns it) or check that the trained embed_tokens was exported",
        )
    report.checks.append("mask embedding row")


def static_check(
    head_dir: Path, target: CheckedTarget, *, method: str = DEFAULT_METHOD,
    report: ValidationReport | None = None,
) -> ValidationReport:
    """All checks that need no engine for a head of ``method``; fills and returns a report (does not raise)."""
    method, own_tensors = describe(method), get_method(method).head_tensors
    report = report or ValidationReport(Path(head_dir))
    if not (report.head_dir / CARD_FILE).exists():
        report.warnings.append(f"{CARD_FILE} (model card) is missing")
    config = _load_config(report)
    tensors = _read_tensors(report)
    if config is None or tensors is None:
        return report
    _check_config(report, config, target, method.parallel_drafting)
    try:
        spec = spec_from_config(config, target)
        float_dtype = torch_dtype(config["torch_dtype"]) if config.get("torch_dtype") else None
    except (KeyError, TypeError, ValueError) as err:
        report.problem(f"config.json values cannot describe a head ({err})", "re-export the head")
        return report
    _check_omitted(report, tensors, method)
    shipped = {name: t for name, t in tensors.items() if _normalise(name) not in method.omitted_tensors}
    _check_names_shapes_dtypes(report, shipped, expected_tensors(spec, own_tensors(spec)), float_dtype)
    _check_vocab_maps(report, tensors, config)
    if method.parallel_drafting:
        _check_mask_row(report, tensors, config, target)
    return report


def _check_omitted(report: ValidationReport, tensors: dict[str, torch.Tensor], method: MethodDescription) -> None:
    """A tensor the method's heads must not ship (an EAGLE-3 head's untrained ``mask_hidden``
    would let vLLM serve it with parallel drafting)."""
    for name in sorted(n for n in tensors if _normalise(n) in method.omitted_tensors):
        report.problem(f"{name} is shipped, but {method.display_name} heads must not ship it",
                       f"export the head as {method.name} (it leaves {name} out)")


# ---------------------------------------------------------------- in vLLM


def _probe_prompts(vocab_size: int, mask_id: int | None, n: int = 4, length: int = 24) -> list[list[int]]:
    """Deterministic token-id prompts that avoid the low (special) ids and the mask token."""
    lo = min(16, vocab_size // 4)
    ids = [t for t in range(lo, vocab_size) if t != mask_id]
    return [[ids[(7 * i + 13 * j) % len(ids)] for j in range(length)] for i in range(n)]


def check_in_vllm(
    head_dir: Path,
    target_path: str | Path,
    vllm_cfg,
    *,
    num_speculative_tokens: int = 3,
    method: str = DEFAULT_METHOD,
    max_tokens: int = 24,
    target_revision: str | None = None,
    trust_remote_code: bool = False,
    dtype: str = "auto",
) -> VllmCheck:
    """Serve the head with its target (drafting as ``method`` does) and generate greedily;
    returns what the drafter did."""
    parallel_drafting = describe(method).parallel_drafting
    from peagle.serving import open_llm
    from peagle.serving.generation import generate_from_token_ids
    from peagle.serving.metrics import read_spec_decode_stats

    config = json.loads((Path(head_dir) / CONFIG_FILE).read_text())
    prompts = _probe_prompts(config["vocab_size"], config.get("mask_token_id", config.get("ptd_token_id")))
    spec_cfg = speculative_config(str(Path(head_dir).resolve()), num_speculative_tokens,
                                  parallel_drafting=parallel_drafting)
    with open_llm(
        str(target_path),
        vllm_cfg,
        revision=target_revision,
        trust_remote_code=trust_remote_code,
        dtype=dtype,
        speculative_config=spec_cfg,
    ) as llm:
        engine_start_s = llm.peagle_startup_s
        started = time.perf_counter()
        outputs = generate_from_token_ids(llm, prompts, max_tokens=[max_tokens] * len(prompts))
        generated = time.perf_counter()
        stats = read_spec_decode_stats(llm)
    return VllmCheck(
        num_speculative_tokens=num_speculative_tokens,
        parallel_drafting=parallel_drafting,
        engine_start_s=engine_start_s,
        generate_s=generated - started,
        output_tokens=sum(len(o.token_ids) for o in outputs),
        num_drafts=stats.num_drafts,
        num_draft_tokens=stats.num_draft_tokens,
        num_accepted_tokens=stats.num_accepted_tokens,
        acceptance_length=stats.acceptance_length if stats.num_drafts else None,
        per_position_acceptance=list(stats.per_position_acceptance),
    )


def _judge_vllm_check(report: ValidationReport, check: VllmCheck, min_acceptance_length: float | None) -> None:
    if check.num_drafts == 0 or check.num_draft_tokens == 0:
        report.problem(
            "vLLM loaded the head but proposed no drafts",
            "check that speculative decoding is active (method eagle3, V1 model runner) and the metrics are on",
        )
    expected_tokens = check.num_drafts * check.num_speculative_tokens
    if check.parallel_drafting and check.num_drafts and check.num_draft_tokens != expected_tokens:
        report.warnings.append(
            f"{check.num_draft_tokens} draft tokens for {check.num_drafts} drafts at K={check.num_speculative_tokens}"
        )
    if min_acceptance_length is not None and (check.acceptance_length or 0.0) < min_acceptance_length:
        report.problem(
            f"acceptance length {check.acceptance_length} is below the required {min_acceptance_length}",
            "a head that loads but accepts little usually has a misnamed tensor or mismatched aux layer ids",
        )
    report.checks.append("served in vLLM")


def validate_head(
    head_dir: str | Path,
    target_path: str | Path | CheckedTarget,
    *,
    vllm_cfg=None,
    load_in_vllm: bool = True,
    target_embed: torch.Tensor | None = None,
    method: str = DEFAULT_METHOD,
    num_speculative_tokens: int = 3,
    min_acceptance_length: float | None = None,
    target_revision: str | None = None,
    trust_remote_code: bool = False,
    dtype: str = "auto",
) -> ValidationReport:
    """Check a head of ``method`` against the vLLM contract, then (``load_in_vllm``) serve it
    with its target, drafting as the method does.

    ``target_path`` is the target's directory (or ``CheckedTarget``); ``target_embed``
    overrides the embedding table read from it. Raises ``HeadValidationError`` listing
    every problem and its fix; returns the report (with vLLM's numbers) when all pass.
    """
    head_dir = Path(head_dir)
    if not head_dir.is_dir():
        raise HeadValidationError(head_dir, [Problem("the head directory does not exist", "pass an exported head")])
    if isinstance(target_path, CheckedTarget):
        target = target_path
    else:
        target = read_target(target_path, revision=target_revision, with_embed=target_embed is None)
    if target_embed is not None:
        target.embed = target_embed
    report = static_check(head_dir, target, method=method)
    report.raise_if_failed()
    if load_in_vllm:
        if isinstance(target_path, CheckedTarget):
            raise ValueError("load_in_vllm needs the target's path, not CheckedTarget")
        from peagle.config import VllmConfig

        try:
            check = check_in_vllm(
                head_dir,
                target_path,
                vllm_cfg or VllmConfig(),
                num_speculative_tokens=num_speculative_tokens,
                method=method,
                target_revision=target_revision,
                trust_remote_code=trust_remote_code,
                dtype=dtype,
            )
        except Exception as err:
            report.problem(f"vLLM failed to serve the head: {_first_line(err)}", "read vLLM's log above, fix, re-export")
            report.raise_if_failed()
        report.vllm = check
        _judge_vllm_check(report, check, min_acceptance_length)
        report.raise_if_failed()
    for warning in report.warnings:
        log.warning("%s: %s", head_dir, warning)
    return report


def _first_line(err: Exception) -> str:
    text = re.sub(r"\s+", " ", f"{type(err).__name__}: {err}")
    return text[:400]
