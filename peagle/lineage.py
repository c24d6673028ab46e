"""What a head was trained on, and what differs now: the facts scheduled retraining decides by.

A head's lineage is the dataset's inputs (prompt files by content, the target revision, the
target/data config) plus the training half of its identity (``peagle.identity.training_hash``).
Each part is written down where it is known, so every way of registering a head carries it:

- the data stage records what built the dataset beside it (``data/lineage.json``): each
  prompt source named by what it read (``peagle.data.provenance``: a magpie file once
  written, a hub set at the commit it was read at), never by what the config said before;
- export writes the head's ``lineage.json`` (those inputs + the training hash + the dataset's
  manifests), but only when the checkpoint's own identity (``trainer_state.json``) proves it
  was trained on that dataset with that config;
- ``peagle.publish.registry.register_head`` copies the head's ``lineage.json`` into the
  version's tags (``peagle.lineage.*``), whichever flow or command registers it.

The target revision names the target's content, never where it lies: a hub target's commit
sha (``HfApi().model_info``; offline, the commit the cached snapshot's ref points at), a local
directory's content hash (file names, sizes and sha256). The CLI and a worker agree on it.
Whether to retrain and whether to promote are decided in ``peagle.publish.gate``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from peagle.checkpoint_format import read_trainer_state, resolve_checkpoint
from peagle.config import ConfigError, PipelineConfig, TargetConfig
from peagle.data.provenance import HUB_TIMEOUT_S
from peagle.fileio import sha256_file, write_json_atomic
from peagle.identity import dataset_manifests, head_identity, training_hash
from peagle.layout import LINEAGE_FILE, DataLayout
from peagle.paths import peagle_home

log = logging.getLogger(__name__)

LINEAGE_PREFIX = "peagle.lineage."  # model version tags holding a head's lineage
DATASET_KEYS = ("data_config_hash", "target_revision", "prompt_files")  # what builds a dataset
COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")
DIGEST_CACHE = Path("cache") / "file-sha256.json"  # under PEAGLE_HOME: sha256 of big files by (path, size, mtime)
NAMED_ONLY = "hub:"  # a prompt source a lineage names by its config alone ("hub:<path>@<split>/<subset>")

# Top-level files that decide what a local target computes (config, tokenizer, weights, remote
# code); documentation and peagle's build report of the embedded target do not.
MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".bin", ".pt", ".pth", ".gguf", ".model", ".tiktoken", ".txt",
                       ".jinja", ".py")
NOT_MODEL_FILES = ("build_report.json",)
DOC_STEMS = ("readme", "license", "notice", "use_policy")


# ----------------------------------------------------------------------------- the target's revision


@dataclass(frozen=True)
class TargetRevision:
    value: str  # a hub commit sha, or "local:<content digest>"
    source: str  # how it was found, for the logs ("hub commit of org/name@main", ...)


def target_revision(target: TargetConfig, resolved: str, *, cache_dir: str | Path | None = None) -> TargetRevision:
    """The revision of the target ``resolved`` (``peagle.target.resolve_target``'s answer) names."""
    local = Path(resolved)
    if local.is_dir():
        digest, count = local_content_digest(local)
        return TargetRevision(f"local:{digest[:16]}", f"content hash of {count} model files of a local directory")
    return hub_revision(resolved, target.revision, cache_dir=cache_dir)


def hub_revision(repo_id: str, revision: str | None = None, *, cache_dir: str | Path | None = None) -> TargetRevision:
    """The commit ``repo_id@revision`` (default ``main``) points at on the hub.

    Asks the hub with the user's token (``HF_TOKEN`` or ``hf auth login``'s, as huggingface_hub
    finds it). Offline (``HF_HUB_OFFLINE``) or when the hub cannot answer: the commit the cached
    snapshot's ``refs/<revision>`` names, and the source says so.
    """
    from huggingface_hub import HfApi, is_offline_mode

    ref = revision or "main"
    if COMMIT_SHA.match(ref):
        return TargetRevision(ref, f"the configured commit of {repo_id}")
    why = "HF_HUB_OFFLINE is set"
    if not is_offline_mode():
        try:
            sha = HfApi().model_info(repo_id, revision=ref, timeout=HUB_TIMEOUT_S).sha
            if sha:
                return TargetRevision(sha, f"hub commit of {repo_id}@{ref}")
            why = "the hub returned no commit"
        except Exception as err:  # offline, gated without a token, 5xx, DNS (httpx errors are no OSError)
            why = f"the hub did not answer: {(str(err).strip().splitlines() or [type(err).__name__])[0][:200]}"
    cached = cached_hub_commit(repo_id, ref, cache_dir=cache_dir)
    if cached is None:
        raise ConfigError(
            f"target.model {repo_id!r}: cannot tell its revision ({why}) and the Hugging Face cache holds no "
            f"snapshot of {ref!r}. Unset HF_HUB_OFFLINE and check the network, set HF_TOKEN (or `hf auth login`) "
            "for a gated or private model, or download it once (`hf download`)"
        )
    return TargetRevision(cached, f"commit of the cached snapshot {repo_id}@{ref} ({why})")


def cached_hub_commit(repo_id: str, ref: str, *, cache_dir: str | Path | None = None) -> str | None:
    """The commit the Hugging Face cache's ``refs/<ref>`` of ``repo_id`` names (None: not cached)."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    refs = Path(cache_dir or constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model") / "refs"
    path = refs / ref
    return path.read_text().strip() if path.is_file() else None


def is_model_file(path: Path) -> bool:
    name = path.name
    return (path.is_file() and not name.startswith(".") and path.suffix in MODEL_FILE_SUFFIXES
            and name not in NOT_MODEL_FILES and path.stem.lower() not in DOC_STEMS)


def local_content_digest(root: Path) -> tuple[str, int]:
    """(sha256 over ``name:size:sha256`` of a directory's top-level model files, their count).

    Top level only: transformers and vLLM load a model from there (a hub repo's ``original/``
    weights are not what they serve). File digests are cached by path, size and mtime, so a
    16 GB target is hashed once, not on every scheduled run.
    """
    files = sorted((p for p in Path(root).iterdir() if is_model_file(p)), key=lambda p: p.name)
    if not files:
        raise ConfigError(f"target directory {root} holds no model files (config, tokenizer, weights)")
    digests = cached_digests(files)
    parts = [f"{p.name}:{p.stat().st_size}:{digests[p]}" for p in files]
    return _digest_strings(parts), len(files)


def cached_digests(files: list[Path]) -> dict[Path, str]:
    """sha256 of each file, reusing the digest cache where a file's size and mtime are unchanged."""
    cache_path = peagle_home() / DIGEST_CACHE
    try:
        cache = json.loads(cache_path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        cache = {}
    out, changed = {}, False
    for path in files:
        stat, key = path.stat(), str(path.resolve())
        hit = cache.get(key)
        if hit and hit["size"] == stat.st_size and hit["mtime_ns"] == stat.st_mtime_ns:
            out[path] = hit["sha256"]
            continue
        out[path] = sha256_file(path)
        cache[key] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": out[path]}
        changed = True
    if changed:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(cache_path, cache, durable=False)  # a cache: losing it costs one re-hash
    return out


# ----------------------------------------------------------------------------- the current inputs


def prompt_file_hashes(cfg: PipelineConfig) -> dict[str, str]:
    """Each prompt source named by what the data stage would read from it now, the way the
    dataset's lineage names what it did read (``peagle.data.provenance``): a grown file is new
    prompt data, a moved hub set a new commit. A missing local file is a ConfigError naming it."""
    from peagle.data.provenance import hub_commits, source_digests

    return source_digests(cfg.data.sources, hub_commits(cfg.data.sources))


def data_config_hash(cfg: PipelineConfig, target) -> str:
    """The target and data sections; a local target directory's path left out (its content is the
    target revision), so the same target copied elsewhere (a worker's disk) is the same input."""
    if not cfg.target.is_embedded and Path(target.path).is_dir():
        cfg = cfg.model_copy(update={"target": cfg.target.model_copy(update={"model": "<local directory>"})})
    return cfg.section_hash("target", "data")


def revision_of(cfg: PipelineConfig, target) -> str:
    """The resolved target's revision (``TargetInfo.revision``, set by ``prepare_target``;
    computed here when a caller built the TargetInfo itself)."""
    return target.revision or target_revision(cfg.target, target.path).value


def lineage(cfg: PipelineConfig, target) -> dict[str, str]:
    """What a head trained now would be trained on, known before any work: the keys retraining
    compares with a head's recorded lineage. The dataset is named by the inputs the data stage
    would read now, as it names those it read; the training part is the head identity's own
    (``peagle.identity.training_hash``: bookkeeping never counts)."""
    return {**dataset_inputs(cfg, target), "train_config_hash": training_hash(cfg)}


def dataset_inputs(cfg: PipelineConfig, target, prompt_files: dict[str, str] | None = None) -> dict[str, str]:
    """The part of the lineage that builds the dataset. ``prompt_files``: what the data stage
    read (``DatasetInfo.prompt_files``); by default what it would read now."""
    files = prompt_file_hashes(cfg) if prompt_files is None else prompt_files
    return {"data_config_hash": data_config_hash(cfg, target), "target_revision": revision_of(cfg, target),
            "prompt_files": json.dumps(files, sort_keys=True)}


def record_dataset_inputs(data_dir: str | Path, inputs: dict[str, str]) -> Path:
    """Write what built the dataset beside it (atomic): export reads it back for the head."""
    return write_json_atomic(DataLayout(data_dir).lineage, inputs, sort_keys=True)


def read_dataset_inputs(data_dir: str | Path) -> dict[str, str]:
    """What built the dataset, as ``record_dataset_inputs`` wrote it (empty when it holds none)."""
    path = DataLayout(data_dir).lineage
    return json.loads(path.read_text()) if path.is_file() else {}


def dataset_prompt_files(data_dir: str | Path) -> dict[str, str]:
    """The prompt sources the dataset was built from, by content, as its data stage read them."""
    return json.loads(read_dataset_inputs(data_dir).get("prompt_files", "{}"))


# ----------------------------------------------------------------------------- a head's lineage


def head_lineage(cfg: PipelineConfig, data_dir: str | Path, checkpoint: str | Path, method) -> tuple[dict | None, str]:
    """(the lineage of ``checkpoint``'s head, "") or (None, why it cannot be told).

    Told only when the checkpoint's identity (recorded by the trainer) is this config's on this
    dataset: a lineage stamped on a head trained on other inputs would stop retraining forever.
    """
    data = DataLayout(data_dir)
    if not data.lineage.is_file():
        return None, f"{data.lineage} is missing (the dataset was built outside a pipeline run: `peagle data CONFIG` records it)"
    manifests = dataset_manifests(data_dir)
    trained = read_trainer_state(resolve_checkpoint(checkpoint)).head_identity
    if trained != head_identity(cfg, manifests, method):
        return None, (f"checkpoint {checkpoint} was not trained on {data.root} with this config "
                      "(its head identity differs)")
    inputs = read_dataset_inputs(data_dir)
    return {**{k: inputs[k] for k in DATASET_KEYS}, "train_config_hash": training_hash(cfg, method),
            "data_manifests": json.dumps(manifests, sort_keys=True)}, ""


def write_head_lineage(head_dir: str | Path, cfg: PipelineConfig, data_dir: str | Path, checkpoint: str | Path,
                       method) -> dict | None:
    """Write ``<head>/lineage.json`` (atomic); without a provable lineage write none and say why
    (the next retraining then retrains: the safe side)."""
    values, why = head_lineage(cfg, data_dir, checkpoint, method)
    path = Path(head_dir) / LINEAGE_FILE
    if values is None:
        path.unlink(missing_ok=True)  # an earlier export's lineage would claim these weights
        log.warning("head %s ships no lineage.json: %s; scheduled retraining will retrain it", head_dir, why)
        return None
    write_json_atomic(path, values, sort_keys=True)
    return values


def read_head_lineage(head_dir: str | Path) -> dict[str, str]:
    """A head directory's lineage (empty when it ships none)."""
    path = Path(head_dir) / LINEAGE_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def lineage_tags(values: dict[str, str]) -> dict[str, str]:
    """A lineage as model version tags."""
    return {LINEAGE_PREFIX + k: str(v) for k, v in values.items()}


def recorded_lineage(version) -> dict[str, str]:
    """The lineage tags of a registered model version (empty when it has none)."""
    if version is None:
        return {}
    return {k.removeprefix(LINEAGE_PREFIX): v for k, v in version.tags.items() if k.startswith(LINEAGE_PREFIX)}


# ----------------------------------------------------------------------------- comparing


def lineage_key(values: dict[str, str]) -> str:
    """One short digest of a lineage: names a retraining revision's directory."""
    return _digest_strings(f"{k}={values[k]}" for k in sorted(values))[:12]


def changes_since(recorded: dict[str, str], current: dict[str, str]) -> list[str]:
    """Human-readable differences between a head's recorded lineage and the current inputs."""
    if not recorded:
        return ["the champion has no recorded lineage (registered before heads shipped lineage.json)"]
    changes = []
    old_files = json.loads(recorded.get("prompt_files", "{}"))
    new_files = json.loads(current["prompt_files"])
    for path in sorted(set(old_files) | set(new_files)):
        if path not in old_files:
            changes.append(f"new prompt source {path}")
        elif path not in new_files:
            changes.append(f"prompt source {path} removed")
        elif old_files[path] != new_files[path]:
            changes.append(prompt_source_change(path, old_files[path], new_files[path]))
    for key, what in (("target_revision", "target revision"), ("data_config_hash", "data/target config"),
                      ("train_config_hash", "drafter/train config or method")):
        if recorded.get(key) != current[key]:
            changes.append(f"{what} changed ({recorded.get(key)} -> {current[key]})")
    return changes


def prompt_source_change(path: str, recorded: str, current: str) -> str:
    """Why one prompt source differs from the champion's record (``peagle.data.provenance``'s names)."""
    from peagle.data.provenance import NOT_WRITTEN

    if current == NOT_WRITTEN:
        return f"prompt file {path} is not written yet: its kind: magpie source writes it anew (new prompt data)"
    if recorded.startswith(NAMED_ONLY):
        return (f"prompt source {path} was recorded by name ({recorded}), not by what was read: "
                "retraining records its content")
    if current.startswith("hf:"):
        return f"hub dataset {path} changed ({recorded} -> {current})"
    return f"prompt file {path} changed (new prompt data)"


def _digest_strings(parts) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()
