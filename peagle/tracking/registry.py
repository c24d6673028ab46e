"""The registry gate between training and serving.

Every exported head becomes a version of the target's registered model and takes the
``challenger`` alias, with its lineage (the head's ``lineage.json``) as tags. The ``champion``
alias (what deployments pull) moves only to a head that passed validation and whose weighted
acceptance beats the champion's, both measured in the same evaluation run
(``peagle.tracking.gate``), by the configured margin; every decision is written on the version as tags, so the registry
itself explains why a head is or is not serving. The version's description (what the MLflow
UI shows on its page) is the head's model card as registered.
"""

from __future__ import annotations

import hashlib
import json
import math
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import mlflow.artifacts
import torch
from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, RESOURCE_DOES_NOT_EXIST, ErrorCode
from safetensors import safe_open

from peagle.config import TrackingConfig
from peagle.export.contract import CARD_FILE, CONFIG_FILE, WEIGHTS_FILE
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


@dataclass(frozen=True)
class PromotionDecision:
    promoted: bool
    reason: str
    champion_before: str | None  # version numbers as MLflow reports them ("3")
    champion_after: str | None


def weighted_score(acceptance_by_benchmark: dict[str, float], weights: dict[str, float]) -> float:
    """Weighted mean acceptance over the weighted benchmarks (unweighted ones are ignored).

    A weighted benchmark without a measurement is an error: scoring it as 0 would quietly
    make a head look worse, scoring it as absent would make it look better.
    """
    if not weights or any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
        raise ValueError(f"tracking.benchmark_weights {weights} must be non-negative with a positive sum")
    missing = [b for b, w in weights.items() if w > 0 and b not in acceptance_by_benchmark]
    if missing:
        raise ValueError(
            f"no acceptance measured for weighted benchmark(s) {missing} "
            f"(measured: {sorted(acceptance_by_benchmark)}); evaluate them or drop their weights"
        )
    total = sum(w for w in weights.values() if w > 0)
    return sum(w * float(acceptance_by_benchmark[b]) for b, w in weights.items() if w > 0) / total


def client_of(client_or_tracker: MlflowClient | Tracker) -> MlflowClient:
    return client_or_tracker.client if isinstance(client_or_tracker, Tracker) else client_or_tracker


# ---------------------------------------------------------------------------------------
# Register


def head_file_manifest(head_dir: Path) -> dict[str, dict]:
    """Size and sha256 of every file of a head directory, after checking vLLM's files are there."""
    from peagle.export.contract import head_tensor_names

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


def promote_if_better(
    client: MlflowClient | Tracker,
    name: str,
    version: str | int,
    score: float,
    margin: float,
    validated: bool,
    *,
    measured: Mapping[str, float] | None = None,
) -> PromotionDecision:
    """Move ``champion`` to ``version`` only if it is validated and its score beats the
    champion's by ``margin`` (relative): ``score > champion_score * (1 + margin)``.

    ``measured`` maps champion versions to their scores measured in the same evaluation run
    as ``score`` (``peagle.tracking.gate.measured_champions``); a champion not measured there
    is not compared with: its stored score came from another run (other prompts, K or hardware).
    """
    client = client_of(client)
    version = str(version)
    measured = {str(v): float(s) for v, s in (measured or {}).items()}
    if not all(math.isfinite(s) and s >= 0 for s in (score, *measured.values())):
        raise ValueError(f"scores must be finite acceptances >= 0, got {score} and {measured}")
    if margin < 0:
        raise ValueError(f"promotion margin must be >= 0, got {margin}")
    client.get_model_version(name, version)  # a clear error for an unknown version
    champion = champion_version(client, name)
    before = str(champion.version) if champion else None
    promoted, reason = _decide(champion, version, score, margin, validated, measured)

    client.set_model_version_tag(name, version, TAG_SCORE, repr(float(score)))
    client.set_model_version_tag(name, version, TAG_VALIDATED, str(bool(validated)).lower())
    if before in measured:
        client.set_model_version_tag(name, version, TAG_CHAMPION_SCORE, repr(measured[before]))
    if promoted:
        client.set_registered_model_alias(name, CHAMPION, version)
        if before:
            client.set_model_version_tag(name, before, TAG_SUPERSEDED_BY, version)
    for key, value in {
        TAG_DECISION: "promoted" if promoted else "refused",
        TAG_REASON: reason,
        TAG_CHAMPION_BEFORE: before or "none",
        TAG_MARGIN: repr(float(margin)),
        TAG_DECIDED_AT: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }.items():
        client.set_model_version_tag(name, version, key, value)
    return PromotionDecision(promoted, reason, before, version if promoted else before)


def _decide(champion: ModelVersion | None, version: str, score: float, margin: float, validated: bool,
            measured: Mapping[str, float]):
    if not validated:
        return False, "refused: the head did not pass validation"
    if champion is None:
        return True, f"promoted: first validated head (score {score:.4f}), no champion yet"
    if str(champion.version) == version:
        return False, f"version {version} is already the champion"
    stored = champion.tags.get(TAG_SCORE)
    history = f"; its stored score from its own run, {float(stored):.4f}, is history" if stored else ""
    if str(champion.version) not in measured:
        return False, (
            f"refused: champion v{champion.version} was not measured in this evaluation run{history}. "
            "The gate compares heads measured together (same prompts, K, vLLM and hardware): run the "
            "evaluate stage again, which serves the champion beside the head"
        )
    champion_score = measured[str(champion.version)]
    needed = champion_score * (1 + margin)
    comparison = (f"score {score:.4f} vs champion v{champion.version} {champion_score:.4f} measured in the same "
                  f"run, x (1 + margin {margin:g}) = {needed:.4f}{history}")
    if score > needed:
        return True, f"promoted: {comparison}"
    return False, f"refused: {comparison} (must be strictly greater)"
