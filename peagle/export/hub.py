"""Publish a head directory on the Hugging Face Hub (``peagle push``), where vLLM users look for heads.

Nothing leaves a head that fails the exporter's static checks (run on the head alone, no target
needed) or whose card the Hub would misread: its front matter must parse with huggingface_hub's
``ModelCard`` and name the target's license. A head carries its target's license, so an unknown
one (``other`` without a ``license_name``, what export writes when it could not read it) is
refused rather than published. The card uploaded is the head's with its serve line naming the
repository (``"model": "<repo id>"``) and the target by its hub id: the line a user copies from
the Hub page works as it is. The token is huggingface_hub's own (``HF_TOKEN``, or the store
``hf auth login`` writes), never an argument: it would show in process lists and logs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml
from huggingface_hub import CommitOperationAdd, HfApi, ModelCard, constants, get_token
from huggingface_hub.errors import HfHubHTTPError, HFValidationError
from huggingface_hub.utils import validate_repo_id

from peagle.catalogue import DESCRIPTIONS, MethodDescription
from peagle.contract import CARD_FILE
from peagle.export.card import (
    TARGET_PLACEHOLDER,
    ServeLine,
    TargetMetadata,
    hub_id,
    localize_card,
    read_serve_line,
)
from peagle.export.validate import HeadValidationError, checked_target_from_head, static_check


class PushError(ValueError):
    """A head that cannot be published as it is, or a push that cannot start; the message names
    the problem and its fix."""


class UploadError(RuntimeError):
    """The Hub refused or failed the upload (permissions, network); the message says what it said."""


@dataclass(frozen=True)
class HeadUpload:
    """What ``peagle push`` sends: every file of ``head_dir`` (its card as the Hub shows it) to ``repo_id``."""

    head_dir: Path
    repo_id: str
    files: dict[str, int]  # path in the repository -> bytes, in upload order
    card: str  # README.md as uploaded
    method: MethodDescription
    warnings: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return f"{constants.ENDPOINT}/{self.repo_id}"

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())


def plan_upload(head_dir: str | Path, repo_id: str) -> HeadUpload:
    """Check ``head_dir`` and its card for the Hub and say what would go to ``repo_id``; reads
    nothing from the network (``peagle push --dry-run`` shows this)."""
    head_dir = Path(head_dir).expanduser().resolve()
    _check_repo_id(repo_id)
    card_file = head_dir / CARD_FILE
    if not head_dir.is_dir():
        raise PushError(f"{head_dir} is not a directory: pass an exported head (`peagle export CONFIG` writes "
                        "<run>/heads/<method>)")
    if not card_file.is_file():
        raise PushError(f"{head_dir} has no {CARD_FILE} (its model card): export the head again (`peagle export CONFIG`)")
    text = card_file.read_text()
    try:
        line = read_serve_line(text)
    except ValueError as err:
        raise PushError(f"{card_file}: {err}") from None
    if line is None:
        raise PushError(f"{card_file} has no `vllm serve` line: export the head again (`peagle export CONFIG`)")
    method = method_drafting(line.parallel_drafting)
    report = static_check(head_dir, checked_target_from_head(head_dir), method=method.name)
    if not report.ok:
        raise PushError(str(HeadValidationError(head_dir, report.problems)))
    card, warnings = hub_card(text, card_file, line, repo_id)
    files = {**head_files(head_dir), CARD_FILE: len(card.encode())}
    return HeadUpload(head_dir, repo_id, files, card, method, tuple(warnings))


def push_head(upload: HeadUpload, *, private: bool = False, revision: str | None = None) -> str:
    """Upload ``upload`` as one commit (the repository and the ``revision`` branch created when
    missing; an existing repository keeps its visibility); returns the commit's URL."""
    if constants.is_offline_mode():
        raise PushError("HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set, so the Hub cannot be reached: unset it to push "
                        "(`peagle push --dry-run` lists the upload offline)")
    if get_token() is None:
        raise PushError("no Hugging Face token: set HF_TOKEN to a token with write access, or run `hf auth login`")
    api = HfApi()
    try:
        api.create_repo(upload.repo_id, private=private, exist_ok=True)
        if revision:
            api.create_branch(upload.repo_id, branch=revision, exist_ok=True)
        commit = api.create_commit(upload.repo_id, operations=_operations(upload), revision=revision,
                                   commit_message=f"Upload {upload.method.display_name} head (peagle)")
    except (HfHubHTTPError, httpx.HTTPError, OSError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UploadError(f"{upload.repo_id}: the upload failed: {reason}") from None
    return commit.commit_url


def method_drafting(parallel_drafting: bool) -> MethodDescription:
    """The drafting method of a head whose card serves it with ``parallel_drafting``: the weights
    are checked against it (a P-EAGLE head ships ``mask_hidden``, an EAGLE-3 head must not)."""
    return next(m for m in DESCRIPTIONS.values() if m.parallel_drafting == parallel_drafting)


def hub_card(card_text: str, card_file: Path, line: ServeLine, repo_id: str) -> tuple[str, list[str]]:
    """The card as the Hub gets it, its serve line naming ``repo_id`` and the target's hub id, and
    what to warn of; a card whose metadata does not parse or names no license is refused."""
    try:
        data = ModelCard(card_text).data
    except (ValueError, yaml.YAMLError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise PushError(f"{card_file}: its front matter is not Hub metadata ({reason}); export the head again") from None
    if not TargetMetadata(license=data.license, license_name=data.license_name).license_known:
        raise PushError(
            f"{card_file} names no license of the target (license: {data.license or 'none'}), and the head carries "
            "the target's: set `license` in its front matter to the target's Hub license id (its Hub page shows "
            "it), or set card.license in the config and export again")
    base = data.base_model
    if base is not None and not (isinstance(base, str) and hub_id(base)):
        raise PushError(f"{card_file}: base_model {base!r} is not a hub id (org/name); set card.base_model in the "
                        "config and export again")
    warnings = [] if base else [
        "the card names no base_model (the target's hub id), so the Hub does not list the head under its target: "
        "set card.base_model in the config and export again"]
    target_ref = hub_id(line.target_ref) or base or TARGET_PLACEHOLDER
    if target_ref == TARGET_PLACEHOLDER:
        warnings.append(f"the card's serve line names no target ({TARGET_PLACEHOLDER}): users must put it in")
    return localize_card(card_text, target_ref=target_ref, head_ref=repo_id), warnings


def head_files(head_dir: Path) -> dict[str, int]:
    """Every file of the head directory (hidden ones left out) and its size."""
    files = {}
    for path in sorted(head_dir.rglob("*")):
        relative = path.relative_to(head_dir)
        if path.is_file() and not any(part.startswith(".") for part in relative.parts):
            files[relative.as_posix()] = path.stat().st_size
    return files


def _check_repo_id(repo_id: str) -> None:
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise PushError(f"REPO_ID {repo_id!r} is not a Hub repository id: use org/name ({err})") from None
    if repo_id.count("/") != 1:
        raise PushError(f"REPO_ID {repo_id!r}: name the owner too, as org/name (or your user name/name)")


def _operations(upload: HeadUpload) -> list[CommitOperationAdd]:
    return [CommitOperationAdd(path_in_repo=name, path_or_fileobj=upload.card.encode() if name == CARD_FILE
                               else str(upload.head_dir / name)) for name in upload.files]
