"""Warm start: begin training from an exported head (e.g. the registry champion).

Scheduled retraining adds prompt data, so the draft vocabulary (the Vd most frequent
target tokens of the data) may have changed since the champion was trained. Every
weight but ``lm_head`` is vocabulary-independent and is copied as is; ``lm_head`` rows
are copied for the draft tokens the old head also had (found through its ``d2t``), and
rows of tokens new to the draft vocabulary keep their fresh initialisation (the
target's own lm_head rows, see ``PEagleDrafter.from_target``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

HEAD_WEIGHTS = "model.safetensors"
VOCAB_TENSORS = ("d2t", "t2d")


@dataclass
class WarmStart:
    head_dir: str
    lm_head_rows_copied: int  # draft tokens the old head also had
    lm_head_rows_new: int  # draft tokens new since the old head: target-initialised rows


def head_draft_ids(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The target ids of an exported head's lm_head rows (``d2t`` offsets; none shipped = all V)."""
    rows = tensors["lm_head.weight"].shape[0]
    offsets = tensors.get("d2t")
    return torch.arange(rows) + (offsets.long() if offsets is not None else 0)


def lm_head_row_sources(old_ids: torch.Tensor, new_ids: torch.Tensor) -> torch.Tensor:
    """Long [Vd_new]: the old lm_head row of each new draft token, -1 where the old head lacked it."""
    position = torch.full((int(max(old_ids.max(), new_ids.max())) + 1,), -1, dtype=torch.long)
    position[old_ids] = torch.arange(old_ids.numel())
    return position[new_ids]


def warm_start(drafter: nn.Module, head_dir: str | Path, draft_ids: torch.Tensor) -> WarmStart:
    """Load an exported head's weights into ``drafter`` (same architecture, any draft vocabulary).

    Refuses, naming the tensors, a head of another shape (other width, depth or target):
    warm starting from it would silently train something else.
    """
    head_dir = Path(head_dir)
    path = head_dir / HEAD_WEIGHTS
    if not path.exists():
        raise FileNotFoundError(
            f"train.init_from={head_dir}: no {HEAD_WEIGHTS} there; point it at an exported head directory "
            "(peagle export) or set it to 'champion'"
        )
    tensors = load_file(str(path))
    old_ids = head_draft_ids(tensors)
    weights = {k: v for k, v in tensors.items() if k not in VOCAB_TENSORS}
    state = drafter.state_dict()
    missing, unexpected = sorted(set(state) - set(weights)), sorted(set(weights) - set(state))
    wrong = sorted(k for k in state if k in weights and k != "lm_head.weight" and weights[k].numel() != state[k].numel())
    if weights["lm_head.weight"].shape[1:] != state["lm_head.weight"].shape[1:]:
        wrong.append("lm_head.weight")
    if missing or unexpected or wrong:
        raise ValueError(
            f"cannot warm start from {head_dir}: its head has another architecture (missing {missing}, "
            f"unexpected {unexpected}, other shapes {wrong}); warm start only from a head of the same drafter and target config, "
            "or unset train.init_from"
        )
    new_ids = torch.as_tensor(draft_ids, dtype=torch.long)
    source = lm_head_row_sources(old_ids, new_ids)
    copied = source >= 0
    loaded = {k: weights[k].reshape(state[k].shape).to(state[k].dtype) for k in state if k != "lm_head.weight"}
    lm_head = state["lm_head.weight"].clone()
    lm_head[copied] = weights["lm_head.weight"][source[copied]].to(lm_head.dtype)
    loaded["lm_head.weight"] = lm_head
    drafter.load_state_dict(loaded, strict=True)
    return WarmStart(str(head_dir), int(copied.sum()), int((~copied).sum()))
