"""Write a trained drafter as a head directory vLLM serves (as its drafting method says).

``config.json`` + ``model.safetensors`` + ``README.md``, assembled in a temporary
directory beside the destination, validated against the contract, then renamed into
place: a head that fails validation is never published, and a crash never leaves a
half-written head where a later step would trust it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from peagle.catalogue import DEFAULT_METHOD, describe
from peagle.checkpoint_format import resolve_checkpoint
from peagle.contract import (
    CARD_FILE,
    CONFIG_FILE,
    FORMAT_VERSION,
    MASK_HIDDEN,
    WEIGHTS_FILE,
    draft_vocab_size,
    expected_tensors,
    fc_input_size,
    head_config,
    ships_d2t,
)
from peagle.export.card import ModelCardInfo, render_model_card
from peagle.export.validate import (
    CheckedTarget,
    ValidationReport,
    checked_target_from_spec,
    dtype_name,
    read_target,
    torch_dtype,
    validate_head,
)
from peagle.facts import HeadSpec, load_dataset_facts
from peagle.fileio import staged_dir
from peagle.layout import VOCAB_FILE, CheckpointLayout, DataLayout
from peagle.methods import get_method

VOCAB_KEYS = ("draft_ids", "d2t", "t2d")


class ExportError(ValueError):
    """The inputs cannot make a valid head; the message names the problem and the fix."""


@dataclass(frozen=True)
class VocabMaps:
    """The draft vocabulary: ``draft_ids`` ascending target ids, ``d2t`` offsets, ``t2d`` membership."""

    draft_ids: torch.Tensor  # int64 [Vd]
    d2t: torch.Tensor  # int64 [Vd], target_id = i + d2t[i]
    t2d: torch.Tensor  # bool [V]


def load_vocab(path: str | Path) -> VocabMaps:
    """Read ``vocab.safetensors`` (peagle.data's format) without trusting it yet."""
    path = Path(path)
    if not path.exists():
        raise ExportError(f"{path}: draft vocabulary not found; run the data stage (it writes {VOCAB_FILE})")
    tensors = load_file(str(path))
    missing = [k for k in VOCAB_KEYS if k not in tensors]
    if missing:
        raise ExportError(f"{path}: lacks {missing}; rebuild the draft vocabulary with the data stage")
    return VocabMaps(*(tensors[k] for k in VOCAB_KEYS))


def _as_vocab_maps(vocab) -> VocabMaps:
    if isinstance(vocab, VocabMaps):
        return vocab
    get = vocab.__getitem__ if isinstance(vocab, Mapping) else lambda k: getattr(vocab, k)
    try:
        return VocabMaps(*(torch.as_tensor(get(k)) for k in VOCAB_KEYS))
    except (KeyError, AttributeError) as err:
        raise ExportError(f"vocab must provide {VOCAB_KEYS} (got {type(vocab).__name__}: {err})") from None


def check_vocab(vocab, spec: HeadSpec) -> VocabMaps:
    """The draft vocabulary must match the spec and be self-consistent (ids, offsets, membership)."""
    maps = _as_vocab_maps(vocab)
    v, vd = spec.vocab_size, draft_vocab_size(spec)
    ids, d2t, t2d = maps.draft_ids.long(), maps.d2t.long(), maps.t2d.bool()
    if ids.shape != (vd,) or d2t.shape != (vd,) or t2d.shape != (v,):
        raise ExportError(
            f"draft vocabulary shapes draft_ids {list(ids.shape)}, d2t {list(d2t.shape)}, t2d {list(t2d.shape)} "
            f"do not match the head spec (Vd={vd}, V={v}); export with the data dir the drafter was trained on"
        )
    if ids.min() < 0 or ids.max() >= v or (vd > 1 and not (ids[1:] > ids[:-1]).all()):
        raise ExportError("draft_ids must be strictly ascending target ids in [0, V); rebuild the draft vocabulary")
    if not torch.equal(d2t, ids - torch.arange(vd)):
        raise ExportError("d2t is not draft_ids - arange(Vd) (vLLM reads offsets); rebuild the draft vocabulary")
    if int(t2d.sum()) != vd or not t2d[ids].all():
        raise ExportError("t2d does not mark exactly the draft_ids; rebuild the draft vocabulary")
    return VocabMaps(ids, d2t, t2d)


def _float_dtype(state_dict: Mapping[str, torch.Tensor], dtype) -> torch.dtype:
    if dtype is not None:
        return torch_dtype(dtype) if isinstance(dtype, str) else dtype
    floats = {t.dtype for t in state_dict.values() if t.is_floating_point()}
    return floats.pop() if len(floats) == 1 else torch.float32


def head_tensors(
    state_dict: Mapping[str, torch.Tensor], spec: HeadSpec, vocab: VocabMaps, dtype: torch.dtype,
    *, method: str = DEFAULT_METHOD,
) -> dict[str, torch.Tensor]:
    """The drafter's state dict renamed to nothing, checked, cast, plus the vocab maps.

    The drafting method's ``omitted_tensors`` are left out (an EAGLE-3 head drops the
    untrained ``mask_hidden``, so nothing can serve it with parallel drafting by mistake).
    """
    rules = expected_tensors(spec, get_method(method).head_tensors(spec))
    state_dict = {k: v for k, v in state_dict.items() if k not in describe(method).omitted_tensors}
    from_vocab = {"d2t": vocab.d2t, "t2d": vocab.t2d}
    for name, maps_tensor in from_vocab.items():
        if name in state_dict and state_dict[name].shape == maps_tensor.shape:
            if not torch.equal(state_dict[name].long(), maps_tensor.long()):
                raise ExportError(
                    f"the drafter's {name} differs from the data dir's vocab.safetensors; "
                    "export with the data dir the drafter was trained on"
                )
    weights = {k: v for k, v in state_dict.items() if k not in from_vocab}
    wanted = {k for k in rules if k not in from_vocab}
    missing, unexpected = sorted(wanted - set(weights)), sorted(set(weights) - wanted)
    if missing or unexpected:
        raise ExportError(
            f"the drafter's state dict does not have the head's names: missing {missing}, unexpected "
            f"{unexpected}; the drafter module must use vLLM's names (docs/design.md, 'Head')"
        )
    out: dict[str, torch.Tensor] = {}
    for name in sorted(wanted):
        tensor = weights[name].detach().cpu()
        if name == MASK_HIDDEN:
            if tensor.numel() != fc_input_size(spec):
                raise ExportError(f"mask_hidden has {tensor.numel()} elements, expected {fc_input_size(spec)} (3 x Ht)")
            tensor = tensor.reshape(rules[name].shape)
        elif tuple(tensor.shape) != rules[name].shape:
            raise ExportError(
                f"{name} has shape {list(tensor.shape)} but the head spec needs {list(rules[name].shape)}; "
                "the checkpoint and head_spec.json disagree"
            )
        out[name] = tensor.to(dtype).contiguous()
    if ships_d2t(spec):
        out["d2t"] = vocab.d2t.to(torch.int64).contiguous()
    out["t2d"] = vocab.t2d.to(torch.bool).contiguous()
    return out


def _target_for_checks(spec: HeadSpec, target_path, target_embed) -> tuple[CheckedTarget, str | None]:
    """The target to validate against: its directory when known, else the spec's numbers."""
    path = target_path or (spec.target if Path(spec.target).is_dir() else None)
    target = read_target(path, with_embed=target_embed is None) if path else checked_target_from_spec(spec)
    if target_embed is not None:
        target.embed = target_embed
    return target, (str(path) if path else None)


def export_head(
    state_dict: Mapping[str, torch.Tensor],
    spec: HeadSpec,
    vocab,
    out_dir: str | Path,
    card: ModelCardInfo | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    target_path: str | Path | None = None,
    target_embed: torch.Tensor | None = None,
    load_in_vllm: bool = False,
    vllm_cfg=None,
    overwrite: bool = False,
    method: str = DEFAULT_METHOD,
) -> Path:
    """Write the head directory of a ``method`` drafter for ``spec``'s target; return its path.

    The method decides the tensors shipped (EAGLE-3: no ``mask_hidden``) and the card (its
    serve line drafts in parallel only for a parallel-drafting method).

    ``vocab`` is a ``VocabMaps`` or anything with ``draft_ids``/``d2t``/``t2d``. Float
    tensors are cast to ``dtype`` (default: the state dict's). The head is validated
    before it is moved into place (against ``target_path``'s config and embedding when
    given, plus a vLLM round trip when ``load_in_vllm``); a failing head raises
    ``HeadValidationError`` and nothing is published.
    """
    out_dir = Path(out_dir).resolve()
    if spec.draft_vocab_size is None:
        spec = spec.with_draft_vocab(len(_as_vocab_maps(vocab).draft_ids))
    maps = check_vocab(vocab, spec)
    float_dtype = _float_dtype(state_dict, dtype)
    tensors = head_tensors(state_dict, spec, maps, float_dtype, method=method)
    card = replace(card or ModelCardInfo(), method=describe(method).name)
    target, target_ref = _target_for_checks(spec, target_path, target_embed)

    if out_dir.exists() and not overwrite:
        raise ExportError(f"{out_dir} already exists; pass overwrite=True or choose another directory")
    with staged_dir(out_dir, overwrite=overwrite) as tmp:  # published whole, only once validated
        (tmp / CONFIG_FILE).write_text(json.dumps(head_config(spec, dtype_name(float_dtype)), indent=2) + "\n")
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", "peagle_format": str(FORMAT_VERSION)})
        (tmp / CARD_FILE).write_text(render_model_card(card, spec))
        validate_export(tmp, target, target_ref, load_in_vllm=load_in_vllm, vllm_cfg=vllm_cfg, method=method)
    return out_dir


def validate_export(
    tmp: Path, target: CheckedTarget, target_ref: str | None, *, load_in_vllm: bool, vllm_cfg,
    method: str = DEFAULT_METHOD,
) -> ValidationReport:
    """Static checks always; the vLLM round trip only when asked and the target is a path."""
    if load_in_vllm and not target_ref:
        raise ExportError("load_in_vllm needs target_path (the target model's directory)")
    if load_in_vllm:
        return validate_head(tmp, target_ref, vllm_cfg=vllm_cfg, load_in_vllm=True, target_embed=target.embed,
                             method=method)
    return validate_head(tmp, target, load_in_vllm=False, method=method)


def export_from_checkpoint(
    checkpoint_dir: str | Path,
    data_dir: str | Path,
    out_dir: str | Path,
    card: ModelCardInfo | None = None,
    **kwargs,
) -> Path:
    """Export ``<checkpoint>/drafter.safetensors`` in the shape of its ``head_spec.json``, with the
    data dir's vocabulary (the dataset's target facts must be the ones the head was trained on).

    ``checkpoint_dir`` is a step directory or the trainer's ``latest``/``best`` pointer.
    Keyword arguments go to ``export_head`` (dtype, target_path, load_in_vllm, ...).
    """
    try:
        ckpt = CheckpointLayout(resolve_checkpoint(checkpoint_dir))
    except FileNotFoundError as err:
        raise ExportError(str(err)) from None
    data = DataLayout(data_dir)
    for path, fix in (
        (ckpt.drafter, "pass a checkpoint step directory written by the trainer"),
        (ckpt.head_spec, "pass a checkpoint step directory written by the trainer"),
        (data.vocab, f"pass the run's data directory (it holds {VOCAB_FILE})"),
    ):
        if not path.exists():
            raise ExportError(f"{path} not found; {fix}")
    spec = HeadSpec.load(ckpt.head_spec)
    if spec.mask_slot_inputs != "mask":
        raise ExportError(
            f"{ckpt.head_spec}: this head was trained with train.peagle.mask_slot_inputs: {spec.mask_slot_inputs}, a "
            "measurement (each mask slot given the real previous token) that vLLM cannot serve; train with "
            "train.peagle.mask_slot_inputs: mask to export a head"
        )
    if data.facts.exists() and not spec.same_target_as(load_dataset_facts(data)):
        raise ExportError(
            f"{ckpt.head_spec} and {data.facts} differ: the checkpoint was trained on another "
            "dataset; pass the data dir it was trained on"
        )
    state_dict = load_file(str(ckpt.drafter))
    return export_head(state_dict, spec, load_vocab(data.vocab), out_dir, card, **kwargs)
