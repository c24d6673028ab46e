"""The target's hub id and license, for the head's model card.

A head is derived from its target, so its card names the target as ``base_model`` and carries
the target's license. Both are read, never assumed:

- the hub id: ``card.base_model`` when set; else the target itself when ``target.model`` is a hub
  id, or the repository of a local directory inside the Hugging Face cache
  (``models--<org>--<name>/snapshots/<commit>``). The target's own card's ``base_model`` names
  what the target was made from, not the target, so it is not read;
- the license: ``card.license`` when set; else the target's own model card (the directory's
  ``README.md``, or the hub repository's at ``target.revision``: from the cache, downloaded when
  the Hub is reachable) with its ``license_name`` and ``license_link``; else the license
  ``peagle target import-gguf`` read from the GGUF file.

What none of them says stays unknown (None): the card then says ``license: other`` and asks for
the real one, rather than naming a license the target may not have.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import yaml
from huggingface_hub import ModelCard, hf_hub_download
from huggingface_hub.errors import EntryNotFoundError, HFValidationError
from huggingface_hub.utils import validate_repo_id

from peagle.config import PipelineConfig, TargetConfig
from peagle.contract import CARD_FILE
from peagle.export.card import TargetMetadata
from peagle.target.gguf import IMPORT_REPORT

log = logging.getLogger(__name__)

CACHE_REPO_PREFIX = "models--"  # huggingface_hub's cache folder of a model repository


def target_metadata(cfg: PipelineConfig, resolved: str) -> TargetMetadata:
    """The hub id and license of ``cfg``'s target (``resolved``: its directory, or its hub id)."""
    hub = cfg.card.base_model or target_hub_id(cfg.target, resolved)
    if cfg.card.license:
        return TargetMetadata(hub_id=hub, license=cfg.card.license)
    found = target_license(cfg.target, resolved)
    if not found.license_known:
        log.warning("target: its license is unknown (its model card names none): the head's card says "
                    "`license: other` until card.license names it")
    return replace(found, hub_id=hub)


def target_hub_id(target: TargetConfig, resolved: str) -> str | None:
    """The target's hub id: ``resolved`` when it is one, the repository of a directory in the
    Hugging Face cache; None for the embedded target and other local directories."""
    if target.is_embedded:
        return None
    local = Path(resolved)
    return cached_repo_id(local) if local.is_dir() else resolved


def cached_repo_id(directory: Path) -> str | None:
    """The repository a snapshot directory of the Hugging Face cache holds, or None."""
    parts = directory.resolve().parts
    for folder, below in zip(parts, parts[1:]):
        if folder.startswith(CACHE_REPO_PREFIX) and below == "snapshots":
            repo_id = folder.removeprefix(CACHE_REPO_PREFIX).replace("--", "/")
            try:
                validate_repo_id(repo_id)
            except HFValidationError:
                return None
            return repo_id
    return None


def target_license(target: TargetConfig, resolved: str) -> TargetMetadata:
    """The license the target's own model card names, else its GGUF file's; empty when unknown."""
    card = _target_card(target, resolved)
    if card is not None:
        found = _card_license(card)
        if found.license:
            return found
    report = Path(resolved) / IMPORT_REPORT
    if report.is_file():
        return TargetMetadata(license=json.loads(report.read_text()).get("license"))
    return TargetMetadata()


def _target_card(target: TargetConfig, resolved: str) -> Path | None:
    """The target's README.md: in its directory, or its hub repository's (cached or downloaded)."""
    local = Path(resolved)
    if local.is_dir():
        return local / CARD_FILE if (local / CARD_FILE).is_file() else None
    try:
        return Path(hf_hub_download(resolved, CARD_FILE, revision=target.revision))
    except (OSError, EntryNotFoundError, ValueError) as err:  # offline and not cached, no card, gated, ...
        log.info("target: no model card of %s (%s)", resolved, type(err).__name__)
        return None


def _card_license(card: Path) -> TargetMetadata:
    try:
        data = ModelCard.load(card).data
    except (ValueError, yaml.YAMLError) as err:
        log.warning("target: %s has front matter huggingface_hub cannot read (%s)", card, type(err).__name__)
        return TargetMetadata()
    return TargetMetadata(license=data.license, license_name=data.license_name, license_link=data.license_link)
