"""Is a dataset there, and sound? What training checks before it starts any rank, what the data
stage checks before it adds to a dataset, and what ``peagle data --verify`` reports.

Soundness is the shard store's: every shard listed by a manifest matches its size and sha256
(``peagle.data.store.verify_split``), hashed once per file identity, so a store checked before
is not read again unless a shard changed since. A corrupt shard is named with the fix,
``peagle data CONFIG --repair``, which takes it out of its split (``mend_corrupt_shards``) so
the data stage extracts exactly its samples again.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from peagle.data.errors import CorruptShardError, MissingDatasetError
from peagle.data.store import (
    REPAIR_COMMAND,
    ShardCheck,
    drop_shards,
    format_bytes,
    unverified_bytes,
    verify_split,
)
from peagle.layout import MANIFEST_FILE, TRAIN_SPLIT, DataLayout

log = logging.getLogger(__name__)

BUILD_COMMAND = "peagle data CONFIG"


def stored_split_dirs(layout: DataLayout) -> list[Path]:
    """Every split directory of ``layout`` that has a manifest (train, eval, served)."""
    if not layout.splits_dir.is_dir():
        return []
    return [d for d in sorted(layout.splits_dir.iterdir()) if (d / MANIFEST_FILE).exists()]


def verify_store(layout: DataLayout, *, full: bool = False) -> list[ShardCheck]:
    """Every shard of every split, checked (``full``: all hashed again, whatever was recorded);
    a line is logged first when shards must be read."""
    split_dirs = stored_split_dirs(layout)
    if full:
        size = sum(json.loads((d / MANIFEST_FILE).read_text()).get("bytes", 0) for d in split_dirs
                   if _readable(d / MANIFEST_FILE))
        log.info(f"data: hashing every shard of {layout.root} ({format_bytes(size)})")
    else:
        count, size = unverified_bytes(split_dirs)
        if count:
            log.info(f"data: verifying {count} shard(s) of {layout.root} ({format_bytes(size)}) not checked since "
                     "they last changed")
    return [check for split_dir in split_dirs for check in verify_split(split_dir, full=full)]


def _readable(path: Path) -> bool:
    try:
        json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return True


def corrupt_store_message(layout: DataLayout, bad: list[ShardCheck]) -> str:
    listing = "; ".join(f"{c.path} ({c.problem})" for c in bad)
    return (f"{len(bad)} corrupt shard(s) in {layout.root}: {listing}. `{REPAIR_COMMAND}` extracts their samples "
            "again (nothing else is redone)")


def mend_corrupt_shards(layout: DataLayout, mend: bool) -> int:
    """Check every stored shard; a corrupt one is refused (``CorruptShardError``, naming it and
    the fix) or, with ``mend``, taken out of its split so that the data stage extracts its
    samples again. Returns how many shards were taken out."""
    checks = verify_store(layout)
    bad = [c for c in checks if not c.ok]
    if not bad:
        if mend and checks:
            log.info(f"data: all {len(checks)} stored shard(s) in {layout.root} are sound")
        return 0
    if not mend:
        raise CorruptShardError(corrupt_store_message(layout, bad))
    for split_dir in sorted({c.split_dir for c in bad}):
        files = [c.file for c in bad if c.split_dir == split_dir]
        if MANIFEST_FILE in files:
            shutil.rmtree(split_dir)
            log.info(f"data: repair: {split_dir} has an unreadable manifest; the whole split is extracted again")
            continue
        samples = drop_shards(split_dir, files)
        log.info(f"data: repair: {len(files)} corrupt shard(s) of {split_dir.name} removed ({', '.join(files)}); "
                 f"their {samples} samples are extracted again")
    return len(bad)


def check_dataset(data_dir: str | Path) -> None:
    """Before training starts any rank: the dataset is complete (target facts, vocabulary, a
    finished train split) and every shard is sound. ``MissingDatasetError`` or
    ``CorruptShardError`` otherwise, each with its fix."""
    from peagle.facts import load_dataset_facts

    layout = DataLayout(data_dir)
    try:
        load_dataset_facts(layout)
    except FileNotFoundError as err:
        raise MissingDatasetError(f"no usable dataset in {layout.root}: {err}") from None
    for need in (layout.vocab, layout.manifest(TRAIN_SPLIT)):
        if not need.exists():
            raise MissingDatasetError(
                f"no usable dataset in {layout.root}: {need} not found; build it first: `{BUILD_COMMAND}`")
    unfinished = [d.name for d in stored_split_dirs(layout) if _unfinished(d)]
    if unfinished:
        raise MissingDatasetError(
            f"the dataset in {layout.root} is unfinished (split(s) {', '.join(unfinished)}: an interrupted build "
            f"or repair); rerun `{BUILD_COMMAND}` to finish it")
    bad = [c for c in verify_store(layout) if not c.ok]
    if bad:
        raise CorruptShardError(corrupt_store_message(layout, bad))


def _unfinished(split_dir: Path) -> bool:
    try:
        return not json.loads((split_dir / MANIFEST_FILE).read_text()).get("complete", False)
    except (OSError, ValueError):
        return False  # unreadable: verify_store names it as corrupt
