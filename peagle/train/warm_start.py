"""Warm start: begin training from an exported head (e.g. the registry champion).

Scheduled retraining adds prompt data, so the draft vocabulary (the Vd most frequent
target tokens of the data) may have changed since the champion was trained. Every
weight but ``lm_head`` is vocabulary-independent and is copied as is; ``lm_head`` rows
are copied for the draft tokens the old head also had (found through its ``d2t``), and
rows of tokens new to the draft vocabulary keep their fresh initialisation (the
target's own lm_head rows, see ``PEagleDrafter.from_target``).

The drafter being trained has the shape the run's config asks for (``drafter.spec``, what
its checkpoints record); the head's ``config.json`` says the shape it was exported with.
They must agree: a 2-layer champion cannot seed a 4-layer drafter.

A head of another method may seed the drafter (staged training: an EAGLE-3 head, then the
parallel depths). The tensors its method leaves out of heads (an EAGLE-3 head has no
``mask_hidden``) keep the initialisation the trainer gave them, and the report names them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from peagle.catalogue import DESCRIPTIONS
from peagle.contract import CONFIG_FILE
from peagle.contract import WEIGHTS_FILE as HEAD_WEIGHTS

VOCAB_TENSORS = ("d2t", "t2d")
# config.json key of an exported head -> the HeadSpec field it was written from.
SHAPE_KEYS = {
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "intermediate_size": "intermediate_size",
    "target_hidden_size": "target_hidden_size",
    "vocab_size": "vocab_size",
}
# ... and the config key that sets it, to name the fix.
CONFIG_KEYS = {"num_hidden_layers": "drafter.num_layers", "hidden_size": "drafter.hidden_size",
               "num_attention_heads": "drafter.num_heads", "num_key_value_heads": "drafter.num_kv_heads",
               "intermediate_size": "drafter.intermediate_size"}


@dataclass
class WarmStart:
    head_dir: str
    lm_head_rows_copied: int  # draft tokens the old head also had
    lm_head_rows_new: int  # draft tokens new since the old head: target-initialised rows
    kept_fresh: list[str] = field(default_factory=list)  # tensors the head's method does not ship


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


def check_head_shape(head_dir: Path, spec) -> None:
    """Refuse, naming the config keys to change, a head whose config.json shape is not ``spec``'s."""
    config_path = head_dir / CONFIG_FILE
    if not config_path.exists():
        return  # weights only: the tensor shapes are checked below
    config = json.loads(config_path.read_text())
    differ = {key: (config[key], getattr(spec, field)) for key, field in SHAPE_KEYS.items()
              if key in config and config[key] != getattr(spec, field)}
    if differ:
        detail = ", ".join(f"{key} {old} (head) vs {new} (now)" for key, (old, new) in differ.items())
        fix = ", ".join(f"{CONFIG_KEYS[k]}: {old}" for k, (old, _) in differ.items() if k in CONFIG_KEYS)
        raise ValueError(
            f"cannot warm start from {head_dir}: its head has another architecture ({detail}); "
            + (f"set {fix} to match it, " if fix else "")
            + "or unset train.init_from"
        )


def tensors_heads_may_lack() -> set[str]:
    """Drafter tensors some drafting method leaves out of its heads (``omitted_tensors``)."""
    return set().union(*(d.omitted_tensors for d in DESCRIPTIONS.values()))


def warm_start(drafter: nn.Module, head_dir: str | Path, draft_ids: torch.Tensor) -> WarmStart:
    """Load an exported head's weights into ``drafter`` (same architecture, any draft vocabulary).

    Refuses, naming the config keys or tensors, a head of another shape (other width, depth
    or target) than ``drafter.spec``: warm starting from it would silently train something else.
    """
    head_dir = Path(head_dir)
    path = head_dir / HEAD_WEIGHTS
    if not path.exists():
        raise FileNotFoundError(
            f"train.init_from={head_dir}: no {HEAD_WEIGHTS} there; point it at an exported head directory "
            "(peagle export) or set it to 'champion'"
        )
    check_head_shape(head_dir, drafter.spec)
    tensors = load_file(str(path))
    old_ids = head_draft_ids(tensors)
    weights = {k: v for k, v in tensors.items() if k not in VOCAB_TENSORS}
    state = drafter.state_dict()
    lacking = set(state) - set(weights)
    kept_fresh = sorted(lacking & tensors_heads_may_lack())
    missing, unexpected = sorted(lacking - set(kept_fresh)), sorted(set(weights) - set(state))
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
    loaded = {k: weights[k].reshape(state[k].shape).to(state[k].dtype) if k in weights else state[k]
              for k in state if k != "lm_head.weight"}
    lm_head = state["lm_head.weight"].clone()
    lm_head[copied] = weights["lm_head.weight"][source[copied]].to(lm_head.dtype)
    loaded["lm_head.weight"] = lm_head
    drafter.load_state_dict(loaded, strict=True)
    return WarmStart(str(head_dir), int(copied.sum()), int((~copied).sum()), kept_fresh)
