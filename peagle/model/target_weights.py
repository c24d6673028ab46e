"""Read a few named tensors of a Hugging Face target through safetensors, never the model.

Initialising a drafter (embeddings, lm_head rows) and building the frozen target head
(final norm, lm_head rows) need three tensors of a model that may be far larger than
memory. ``safe_open`` reads exactly those, from a single file or a sharded index.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from peagle.facts import text_config

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class TargetWeightsError(ValueError):
    """The target directory lacks a tensor we need; the message says which and why."""


def target_config(target_path: str | Path) -> dict:
    """The target's ``config.json`` as a dict (text part for multimodal configs)."""
    path = Path(target_path) / "config.json"
    if not path.is_file():
        raise TargetWeightsError(f"{path} not found: pass the target's local model directory")
    return text_config(json.loads(path.read_text()))


def _tensor_locations(target_path: Path) -> dict[str, Path]:
    """Map every tensor name of the target to the safetensors file holding it."""
    index = target_path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: target_path / file for name, file in weight_map.items()}
    single = target_path / SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    raise TargetWeightsError(
        f"{target_path} has neither {SINGLE_FILE} nor {INDEX_FILE}: the target's weights must be "
        "stored as safetensors (re-save it with save_pretrained(safe_serialization=True))"
    )


def _pick(names: list[str], suffix: str) -> str | None:
    """The language model's tensor ending in ``suffix`` (shortest name: skips vision towers)."""
    found = [n for n in names if n == suffix or n.endswith("." + suffix)]
    if not found:
        return None
    text = [n for n in found if "vision" not in n and "visual" not in n and "mtp" not in n]
    return min(text or found, key=len)


def read_target_tensor(target_path: str | Path, suffix: str) -> torch.Tensor | None:
    """The target's tensor named ``*suffix`` (e.g. ``embed_tokens.weight``) in its stored dtype,
    read alone; None when the target has no such tensor."""
    locations = _tensor_locations(Path(target_path))
    name = _pick(list(locations), suffix)
    if name is None:
        return None
    with safe_open(str(locations[name]), framework="pt") as f:
        return f.get_tensor(name)


def load_target_tensors(target_path: str | Path, draft_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Return fp32 ``embed_tokens`` [V,Ht], ``norm`` [Ht] and ``lm_head`` [Vd,Ht] of the target.

    ``lm_head`` holds only the rows of ``draft_ids`` (all rows when None); tied embeddings
    (no ``lm_head.weight`` stored, or ``tie_word_embeddings``) reuse the embedding table.
    """
    target_path = Path(target_path)
    cfg = target_config(target_path)
    locations = _tensor_locations(target_path)
    names = list(locations)
    embed_name = _pick(names, "embed_tokens.weight")
    norm_name = _pick([n for n in names if "layers." not in n], "norm.weight")
    head_name = _pick(names, "lm_head.weight")
    if embed_name is None or norm_name is None:
        raise TargetWeightsError(
            f"{target_path}: no '*embed_tokens.weight' or final '*norm.weight' tensor; "
            "only Llama-style targets (model.embed_tokens, model.norm, lm_head) are supported"
        )
    tied = head_name is None or bool(cfg.get("tie_word_embeddings", False))

    def read(name: str) -> torch.Tensor:
        with safe_open(str(locations[name]), framework="pt") as f:
            return f.get_tensor(name).float()

    embed = read(embed_name)
    head = embed if tied else read(head_name)
    if draft_ids is not None:
        draft_ids = torch.as_tensor(draft_ids, dtype=torch.long)
        if draft_ids.numel() and int(draft_ids.max()) >= head.shape[0]:
            raise TargetWeightsError(
                f"draft_ids reach {int(draft_ids.max())} but the target's lm_head has {head.shape[0]} rows; "
                "the draft vocabulary was built for another target"
            )
        head = head[draft_ids]
    return {"embed_tokens": embed, "norm": read(norm_name), "lm_head": head.clone()}
