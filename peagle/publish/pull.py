"""A registry consumer's side: a registered head downloaded, verified file by file against
what was registered, and its card made to serve from where it landed.

``pull_head`` is what ``peagle pull models:/<name>@champion`` runs; ``download_champion`` and
``download_version`` are what the evaluate stage uses to serve the champion beside a new head.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlflow.artifacts
from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode

from peagle.contract import CARD_FILE
from peagle.fileio import publish_dir
from peagle.publish.registry import TAG_FILES, TAG_TARGET, champion_version, client_of, head_file_manifest
from peagle.tracking.mlflow_run import Tracker, file_sha256


def download_champion(client: MlflowClient | Tracker, name: str, dst: str | Path, *, overwrite: bool = False) -> Path:
    """Download the champion head into ``dst`` (config.json + model.safetensors + card),
    verified file by file against the sizes and hashes recorded at registration."""
    client = client_of(client)
    champion = champion_version(client, name)
    if champion is None:
        raise LookupError(f"registered model {name!r} has no champion yet; run the pipeline until a "
                          "validated head is promoted")
    return download_version(client, champion, dst, overwrite=overwrite)


def download_version(
    client: MlflowClient | Tracker,
    version: ModelVersion,
    dst: str | Path,
    *,
    overwrite: bool = False,
    finish: Callable[[Path], None] | None = None,
) -> Path:
    """Download a registered head into ``dst``, verified against its registered file hashes.

    ``finish`` may change the verified copy (``pull_head`` localizes the card) before it
    is renamed into place, so ``dst`` never holds an unverified or half-finished head.
    """
    client = client_of(client)
    dst = Path(dst).resolve()
    if dst.exists() and any(dst.iterdir()) and not overwrite:
        raise FileExistsError(f"{dst} is not empty; choose another directory or pass overwrite=True")

    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        local = Path(mlflow.artifacts.download_artifacts(
            artifact_uri=client.get_model_version_download_uri(version.name, version.version),
            dst_path=str(staging),
            tracking_uri=client.tracking_uri,
        ))
        verify_head_files(local, json.loads(version.tags.get(TAG_FILES, "{}")))
        if finish is not None:
            finish(local)
        publish_dir(local, dst)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dst


_MODEL_URI = re.compile(r"^models:/(?P<name>[^@]+?)(?:@(?P<alias>[A-Za-z0-9_-]+)|/(?P<version>[0-9]+))$")


@dataclass(frozen=True)
class PulledHead:
    path: Path
    name: str
    version: str
    target_ref: str
    serve_line: str | None  # the localized card's `vllm serve` line (None: the version has no card)


def resolve_model_uri(client: MlflowClient | Tracker, uri: str) -> ModelVersion:
    """``models:/<name>@<alias>`` or ``models:/<name>/<version>`` -> that model version."""
    client = client_of(client)
    match = _MODEL_URI.match(uri)
    if not match:
        raise ValueError(f"{uri!r} is not a model version URI; use models:/<name>@<alias> "
                         "(e.g. models:/peagle-embedded@champion) or models:/<name>/<version>")
    name, alias, number = match["name"], match["alias"], match["version"]
    try:
        return client.get_model_version_by_alias(name, alias) if alias else client.get_model_version(name, number)
    except MlflowException as err:
        if err.error_code not in (ErrorCode.Name(RESOURCE_DOES_NOT_EXIST), "INVALID_PARAMETER_VALUE"):
            raise
        raise LookupError(f"{uri}: no such model version on {client.tracking_uri} ({err.message})") from None


def pull_target_ref(version: ModelVersion, target: str | None) -> str:
    """The target the pulled card names: ``target`` as given (a local path made absolute), else
    the hub id recorded with the version. A local or embedded training target is never
    guessed: its path on the training machine means nothing here."""
    from peagle.export.card import hub_id

    if target:
        local = Path(target).expanduser()
        return str(local.resolve()) if local.exists() else target
    recorded = version.tags.get(TAG_TARGET)
    if hub_id(recorded):
        return recorded
    raise ValueError(
        f"version {version.version} of {version.name!r} was trained for target {recorded!r}, which is not a hub id; "
        "pass --target with the target's hub id or local path (the embedded test target's path is printed by "
        "`python -m peagle.testing.embedded`)"
    )


def pull_head(client: MlflowClient | Tracker, uri: str, dst: str | Path, *, target: str | None = None,
              overwrite: bool = False) -> PulledHead:
    """Download the version ``uri`` names into ``dst`` (verified), with a card whose serve line
    names ``dst``, the target (see ``pull_target_ref``) and the registered name as the served model."""
    from peagle.export.card import localize_card, read_serve_line


    version = resolve_model_uri(client, uri)
    target_ref = pull_target_ref(version, target)
    dst = Path(dst).resolve()

    def localize(local: Path) -> None:
        card = local / CARD_FILE
        if card.is_file() and read_serve_line(card.read_text()):  # a card without one stays as written
            card.write_text(localize_card(card.read_text(), target_ref=target_ref, head_ref=str(dst),
                                          served_name=version.name))

    path = download_version(client, version, dst, overwrite=overwrite, finish=localize)
    card = path / CARD_FILE
    line = read_serve_line(card.read_text()) if card.is_file() else None
    return PulledHead(path, version.name, str(version.version), target_ref, line.command() if line else None)


def verify_head_files(head_dir: Path, expected: dict[str, dict]) -> None:
    """Every recorded file is present with its recorded size and sha256; vLLM's files parse."""
    problems = []
    for rel, meta in expected.items():
        path = head_dir / rel
        if not path.is_file():
            problems.append(f"{rel} missing")
        elif path.stat().st_size != meta["bytes"]:
            problems.append(f"{rel} has {path.stat().st_size} bytes, expected {meta['bytes']}")
        elif file_sha256(path) != meta["sha256"]:
            problems.append(f"{rel} sha256 differs from the registered one")
    if problems:
        raise ValueError(f"downloaded head {head_dir} is incomplete or corrupt: {'; '.join(problems)}")
    head_file_manifest(head_dir)  # required files present and readable even without a record
