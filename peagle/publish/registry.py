"""The MLflow registry's reads and writes: versions, their tags and aliases.

Every exported head becomes a version of the target's registered model and takes the
``challenger`` alias, with its lineage (the head's ``lineage.json``) as tags. The ``champion``
alias (what deployments pull) is moved by the gate (``peagle.publish.gate.promote_if_better``),
which writes every decision on the version as tags, so the registry itself explains why a head
is or is not serving. The version's description (what the MLflow UI shows on its page) is the
head's model card as registered. A consumer's pull is ``peagle.publish.pull``.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import mlflow.artifacts
import torch
from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, RESOURCE_DOES_NOT_EXIST, ErrorCode
from safetensors import safe_open

from peagle.config import TrackingConfig
from peagle.contract import CARD_FILE, CONFIG_FILE, WEIGHTS_FILE
from peagle.tracking.mlflow_run import Tracker, file_sha256, make_client, registered_model_name, resolve_tracking_uri
from peagle.tracking.scrub import scrub_text

CHAMPION = "champion"
CHALLENGER = "challenger"
HEAD_FILES = (CONFIG_FILE, WEIGHTS_FILE)  # what vLLM needs from a head directory
MAX_DESCRIPTION_CHARS = 5000  # MLflow's model_versions.description column

TAG_CONTENT = "peagle.content_sha256"  # head_content_digest of the registered head
TAG_FILES = "peagle.files"  # {relative path: {"bytes": n, "sha256": hex}} of the uploaded head
TAG_SCORE = "peagle.score"
TAG_VALIDATED = "peagle.validated"
TAG_DECISION = "peagle.promotion.decision"
TAG_REASON = "peagle.promotion.reason"
TAG_CHAMPION_BEFORE = "peagle.promotion.champion_before"
TAG_CHAMPION_SCORE = "peagle.promotion.champion_score"  # the champion's score measured beside the head
TAG_MARGIN = "peagle.promotion.margin"
TAG_DECIDED_AT = "peagle.promotion.decided_at"
TAG_SUPERSEDED_BY = "peagle.superseded_by"
TAG_TARGET = "target"  # the version tag naming the target the head drafts for (config target.model)


def client_of(client_or_tracker: MlflowClient | Tracker) -> MlflowClient:
    return client_or_tracker.client if isinstance(client_or_tracker, Tracker) else client_or_tracker


# ---------------------------------------------------------------------------------------
# Register


def head_file_manifest(head_dir: Path) -> dict[str, dict]:
    """Size and sha256 of every file of a head directory, after checking vLLM's files are there."""
    from peagle.contract import head_tensor_names

    head_dir = Path(head_dir)
    missing = [f for f in HEAD_FILES if not (head_dir / f).is_file()]
    if missing:
        raise FileNotFoundError(f"head directory {head_dir} lacks {missing}; export the head first (peagle export)")
    head_tensor_names(head_dir)  # config.json parses, the weights' header reads
    return {
        p.relative_to(head_dir).as_posix(): {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(head_dir.rglob("*"))
        if p.is_file()
    }


def ensure_registered_model(client: MlflowClient, name: str) -> None:
    try:
        client.create_registered_model(name, description="P-EAGLE drafter heads (peagle)")
    except MlflowException as err:
        if err.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise


def register_head(
    client: MlflowClient | Tracker,
    run_id: str,
    head_dir: str | Path,
    name: str,
    tags: dict,
    metrics: dict[str, float],
) -> ModelVersion:
    """Upload ``head_dir`` as run artifacts (``heads/<dir name>``) and register it as a new
    version of ``name`` with the ``challenger`` alias, its model card as the description.

    ``tags`` carry what the version is (target id, K, validation status...); ``metrics``
    are written as ``metric.<name>`` tags so the registry view shows them; the head's own
    ``lineage.json`` (what it was trained on) becomes ``peagle.lineage.*`` tags, which
    scheduled retraining compares with its current inputs, whichever flow registers it.
    """
    from peagle.lineage import lineage_tags, read_head_lineage

    client = client_of(client)
    head_dir = Path(head_dir)
    files = head_file_manifest(head_dir)
    artifact_path = f"heads/{head_dir.name}"
    if client.list_artifacts(run_id, artifact_path):
        raise FileExistsError(
            f"run {run_id} already holds artifacts at {artifact_path}; a registered version would "
            "change under its users. Export each head to its own directory name."
        )
    client.log_artifacts(run_id, str(head_dir), artifact_path)
    source = f"{client.get_run(run_id).info.artifact_uri.rstrip('/')}/{artifact_path}"

    version_tags = {str(k): scrub_text(str(v)) for k, v in tags.items()}
    version_tags.update({f"metric.{k}": repr(float(v)) for k, v in metrics.items()})
    version_tags.update(lineage_tags(read_head_lineage(head_dir)))
    version_tags[TAG_FILES] = json.dumps(files, sort_keys=True)
    ensure_registered_model(client, name)
    card = head_dir / CARD_FILE
    description = card_description(card.read_text()) if card.is_file() else None
    version = client.create_model_version(name, source=source, run_id=run_id, tags=version_tags,
                                          description=description)
    client.set_registered_model_alias(name, CHALLENGER, version.version)
    return client.get_model_version(name, version.version)


def card_description(card: str) -> str:
    """A model card as a version description: its Markdown without the Hub's YAML front matter
    (the UI would show it as text), cut to what MLflow stores with a pointer to the whole card."""
    body = card
    if card.startswith("---\n"):
        end = card.find("\n---\n", 4)
        body = card[end + 5:] if end >= 0 else card
    body = body.strip() + "\n"
    if len(body) <= MAX_DESCRIPTION_CHARS:
        return body
    note = f"\n\n... (cut to {MAX_DESCRIPTION_CHARS} characters; the whole card is {CARD_FILE} in the version's files)\n"
    return body[: MAX_DESCRIPTION_CHARS - len(note)] + note


def describe_with_card(client: MlflowClient | Tracker, name: str, version: str) -> bool:
    """Give a version without a description its registered card as one (a version registered
    before peagle set descriptions). A description someone wrote stays. Returns whether it
    was set."""
    client = client_of(client)
    registered = client.get_model_version(name, str(version))
    if registered.description:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        try:
            local = mlflow.artifacts.download_artifacts(
                artifact_uri=f"{client.get_model_version_download_uri(name, registered.version).rstrip('/')}/{CARD_FILE}",
                dst_path=tmp, tracking_uri=client.tracking_uri)
        except (MlflowException, OSError):
            return False  # a version registered without a card
        description = card_description(Path(local).read_text())
    client.update_model_version(name, registered.version, description=description)
    return True


# ---------------------------------------------------------------------------------------
# Promote


def head_content_digest(head_dir: Path) -> str:
    """What a head serves: config.json plus every tensor's name, dtype, shape and bytes.

    Not the file bytes: safetensors writes its metadata map in a per-process order, so two
    exports of the same checkpoint can differ byte-wise; nor the model card (documentation).
    """
    head_dir = Path(head_dir)
    h = hashlib.sha256((head_dir / CONFIG_FILE).read_bytes())
    with safe_open(str(head_dir / WEIGHTS_FILE), framework="pt") as f:
        for key in sorted(f.keys()):
            t = f.get_tensor(key).contiguous()
            h.update(f"{key}:{t.dtype}:{list(t.shape)}".encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def tag_head_content(client: MlflowClient | Tracker, name: str, version: str, head_dir: Path) -> None:
    """Record what the version serves, so publishing the same head again finds it (``registered_twin``)."""
    client_of(client).set_model_version_tag(name, str(version), TAG_CONTENT, head_content_digest(head_dir))


def model_versions(client: MlflowClient | Tracker, name: str) -> list[ModelVersion]:
    """Every version of the registered model ``name``; none when it does not exist yet."""
    try:
        return list(client_of(client).search_model_versions(f"name='{name}'"))
    except MlflowException:
        return []


def registered_twin(client: MlflowClient | Tracker, name: str, head_dir: Path) -> ModelVersion | None:
    """An already registered version serving exactly this head (publishing is idempotent)."""
    content = head_content_digest(head_dir)
    return next((v for v in model_versions(client, name) if v.tags.get(TAG_CONTENT) == content), None)


def champion_and_match(
    tracking: TrackingConfig, target_model: str, matches: Callable[[ModelVersion], bool]
) -> tuple[ModelVersion | None, ModelVersion | None]:
    """The target's champion, and the newest version for which ``matches`` holds (e.g. trained on
    the current inputs); (None, None) while there is no champion."""
    client = make_client(resolve_tracking_uri(tracking))
    name = registered_model_name(tracking, target_model)
    champion = champion_version(client, name)
    if champion is None:
        return None, None
    same = [v for v in model_versions(client, name) if matches(v)]
    return champion, max(same, key=lambda v: int(v.version)) if same else None


def champion_version(client: MlflowClient | Tracker, name: str) -> ModelVersion | None:
    """The version holding the ``champion`` alias, or None when there is none yet."""
    client = client_of(client)
    try:
        aliases = client.get_registered_model(name).aliases
    except MlflowException as err:
        if err.error_code == ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
            return None
        raise
    return client.get_model_version(name, aliases[CHAMPION]) if CHAMPION in aliases else None
