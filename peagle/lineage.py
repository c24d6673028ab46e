"""What a head is trained on, known before any work: the lineage retraining compares.

A registered head carries its lineage as model-version tags (``tag_lineage``); the
retraining flow compares them with the current inputs (``changes_since``) to decide
whether anything changed. The training part is ``peagle.identity.training_hash``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from peagle.config import PipelineConfig
from peagle.fileio import sha256_file as file_digest

LINEAGE_PREFIX = "peagle.lineage."


def prompt_file_hashes(cfg: PipelineConfig) -> dict[str, str]:
    """sha256 of every local prompt file (a grown file is new prompt data); hub sets by name."""
    from peagle.config import resolve_repo_path

    hashes = {}
    for src in cfg.data.sources:
        path = resolve_repo_path(src.path)
        if src.kind == "hf" or not path.exists():
            hashes[src.path] = f"hub:{src.path}@{src.split}/{src.subset or ''}"
        elif path.is_dir():
            hashes[src.path] = _digest_strings(f"{p.relative_to(path)}:{file_digest(p)}"
                                               for p in sorted(path.rglob("*")) if p.is_file())
        else:
            hashes[src.path] = file_digest(path)
    return hashes


def target_revision(cfg: PipelineConfig, target) -> str:
    """The configured revision, else a digest of the resolved target's config and weight files
    (``target``: a ``peagle.stages.TargetInfo``; the directory's name counts, never its absolute
    path: the CLI and a worker may differ)."""
    if cfg.target.revision:
        return cfg.target.revision
    root = Path(target.path)
    parts = [root.resolve().name]
    if (root / "config.json").exists():
        parts.append(file_digest(root / "config.json"))
    parts += [f"{p.name}:{p.stat().st_size}" for p in sorted(root.glob("*.safetensors"))]
    return "local:" + _digest_strings(parts)[:16]


def _digest_strings(parts) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def lineage(cfg: PipelineConfig, target) -> dict[str, str]:
    """What a head is trained on, known before any work: the keys retraining compares.

    The dataset is named by what builds it (it is not built yet); the training part is the
    head identity's own (``peagle.identity.training_hash``: bookkeeping never counts).
    """
    from peagle.identity import training_hash

    return {
        "data_config_hash": cfg.section_hash("target", "data"),
        "train_config_hash": training_hash(cfg),
        "target_revision": target_revision(cfg, target),
        "prompt_files": json.dumps(prompt_file_hashes(cfg), sort_keys=True),
    }


def lineage_key(values: dict[str, str]) -> str:
    """One short digest of a lineage: names a retraining revision's directory."""
    return _digest_strings(f"{k}={values[k]}" for k in sorted(values))[:12]


def changes_since(recorded: dict[str, str], current: dict[str, str]) -> list[str]:
    """Human-readable differences between a head's recorded lineage and the current inputs."""
    if not recorded:
        return ["the champion has no recorded lineage (trained before lineage tags existed)"]
    changes = []
    old_files = json.loads(recorded.get("prompt_files", "{}"))
    new_files = json.loads(current["prompt_files"])
    for path in sorted(set(old_files) | set(new_files)):
        if path not in old_files:
            changes.append(f"new prompt source {path}")
        elif path not in new_files:
            changes.append(f"prompt source {path} removed")
        elif old_files[path] != new_files[path]:
            changes.append(f"prompt file {path} changed (new prompt data)")
    for key, what in (("target_revision", "target revision"), ("data_config_hash", "data/target config"),
                      ("train_config_hash", "drafter/train config or method")):
        if recorded.get(key) != current[key]:
            changes.append(f"{what} changed ({recorded.get(key)} -> {current[key]})")
    return changes


def recorded_lineage(version) -> dict[str, str]:
    """The lineage tags of a registered model version (empty when it has none)."""
    if version is None:
        return {}
    return {k.removeprefix(LINEAGE_PREFIX): v for k, v in version.tags.items() if k.startswith(LINEAGE_PREFIX)}


def tag_lineage(tracker, name: str, version: str, values: dict[str, str]) -> None:
    """Write a head's lineage on its registered version, where retraining reads it back."""
    for key, value in values.items():
        tracker.client.set_model_version_tag(name, str(version), LINEAGE_PREFIX + key, value)


def revision_config(cfg: PipelineConfig, current: dict[str, str]) -> PipelineConfig:
    """The same config, writing checkpoints and heads under a directory of its own inputs
    (``<run>/revisions/<lineage key>``)."""
    from peagle.layout import RunLayout

    workdir = RunLayout(cfg.run_dir).revision(lineage_key(current))
    return cfg.model_copy(update={"workdir": str(workdir)})


def registry_state(cfg: PipelineConfig, current: dict[str, str]):
    """(champion, its lineage, the newest version already trained on exactly ``current`` or None)."""
    from peagle.tracking.registry import champion_and_match

    champion, latest = champion_and_match(
        cfg.tracking, cfg.target.model, lambda v: not changes_since(recorded_lineage(v), current))
    return champion, recorded_lineage(champion), latest
