"""What a drafter checkpoint directory holds, as every stage reads it: the trainer writes it
(``peagle.train.checkpoint``), export, lineage and evaluation read it, and none of them needs the
trainer (DeepSpeed, torch) for that.

``<root>/step-NNNNNN/`` holds ``drafter.safetensors`` (the drafter's state dict in vLLM's head
names), ``head_spec.json`` (the ``HeadSpec`` it was trained for), ``trainer_state.json``
(``TrainerState``: where training stands, as JSON) and the optimizer's state. ``latest`` and
``best`` are small pointer files naming a step directory; a visible ``step-*`` directory is
always complete (it is written under ``.tmp-step-NNNNNN`` and renamed).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from peagle.facts import HeadSpec
from peagle.fileio import write_text_atomic
from peagle.layout import BEST, LATEST, CheckpointLayout

PREFIX = "step-"
TMP_PREFIX = ".tmp-"
STATE_VERSION = 2


# ----------------------------------------------------------------------------- trainer state


@dataclass
class TrainerState:
    """Where training stands; everything a resume needs besides DeepSpeed's own state."""

    step: int  # optimizer steps completed
    epoch: int  # epoch the next step belongs to
    epoch_position: int  # micro-batches of that epoch this rank has already consumed
    world_size: int
    steps_per_epoch: int
    micro_batch_size: int
    grad_accum: int
    total_steps: int
    # The ZeRO stage that partitioned it (None: not recorded): a resume at another stage, as at
    # another world size, rebuilds from the consolidated state (train.launch is never what a head is).
    zero_stage: int | None = None
    head_identity: str = ""  # peagle.identity.head_identity of the head it trains
    train_seconds: float = 0.0  # summed optimizer-step seconds so far (a time budget's clock)
    counted_steps: int | None = None  # of the steps, those train_seconds counts (None: written before the rule)
    acceptance: float | None = None  # offline acceptance of this checkpoint, when evaluated
    metrics: dict = field(default_factory=dict)  # the last step's logged metrics
    replica_checksums: list[float] = field(default_factory=list)  # per rank: all must agree
    rng: dict = field(default_factory=dict)  # rank 0's RNG states
    version: int = STATE_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> TrainerState:
        data = json.loads(text)
        if data.get("version") != STATE_VERSION:
            raise ValueError(f"trainer state version {data.get('version')} is not {STATE_VERSION}: the checkpoint was "
                             "written by another peagle version; delete its directory or train into another workdir")
        return cls(**data)


# ----------------------------------------------------------------------------- step directories and pointers


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:06d}"


def checkpoint_step(path: Path) -> int:
    return int(Path(path).name[len(PREFIX) :])


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (temp directories are never listed)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit()]
    return sorted(found, key=checkpoint_step)


def write_pointer(root: Path, name: str, checkpoint: str, **fields) -> None:
    """Point ``<root>/<name>`` (``latest`` or ``best``) at step directory ``checkpoint``, atomically."""
    write_text_atomic(Path(root) / name, json.dumps({"checkpoint": checkpoint, **fields}))


def _pointer(root: Path, name: str) -> Path | None:
    path = Path(root) / name
    if not path.is_file():
        return None
    target = Path(root) / json.loads(path.read_text())["checkpoint"]
    return target if target.is_dir() else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A step directory as given; a ``latest``/``best`` pointer file -> the step it names.

    The one reader of pointers for callers handed a path (``peagle export --checkpoint``),
    so a pointer is never mistaken for a directory name.
    """
    path = Path(path)
    if path.name in (LATEST, BEST) and not path.is_dir():
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: no {path.name!r} checkpoint yet (the trainer writes it); train first "
                "(peagle train) or pass a step directory (--checkpoint .../step-NNNNNN)"
            )
        step = _pointer(path.parent, path.name)
        if step is None:
            raise FileNotFoundError(
                f"{path} names {json.loads(path.read_text())['checkpoint']!r}, which is not in {path.parent}; "
                "retrain or pass an existing step directory"
            )
        return step.resolve()
    return path.resolve()


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint (what a resume continues from)."""
    return _pointer(root, LATEST)


def best_checkpoint(root: Path) -> Path | None:
    """The checkpoint with the highest offline acceptance so far (None before any evaluation)."""
    return _pointer(root, BEST)


def best_acceptance(root: Path) -> float | None:
    path = Path(root) / BEST
    return json.loads(path.read_text())["acceptance"] if path.is_file() and _pointer(root, BEST) else None


def read_trainer_state(checkpoint: Path) -> TrainerState:
    return TrainerState.from_json(CheckpointLayout(checkpoint).trainer_state.read_text())


def read_head_spec(checkpoint: Path) -> HeadSpec:
    """The head a checkpoint holds (its shape, target facts, method and k_train)."""
    return HeadSpec.load(CheckpointLayout(checkpoint).head_spec)


def check_same_head(checkpoint: Path, spec: HeadSpec) -> None:
    """Refuse to resume ``checkpoint`` into another head (e.g. ``drafter.num_layers`` changed)."""
    old = read_head_spec(checkpoint)
    differ = {
        f.name: (getattr(old, f.name), getattr(spec, f.name))
        for f in fields(HeadSpec)
        if getattr(old, f.name) != getattr(spec, f.name)
    }
    if differ:
        detail = ", ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in differ.items())
        raise ValueError(
            f"cannot resume from {checkpoint}: it holds another head ({detail}); "
            "use a fresh output directory (another workdir) or restore the drafter/train config"
        )
