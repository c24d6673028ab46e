"""What the data stage reads from each prompt source, named by content: the ``prompt_files``
a dataset's lineage records (``peagle.lineage``) and scheduled retraining compares.

One function names a source the same way before a build (the current inputs), while it reads
(what the dataset's lineage records) and after it (retraining's comparison):

- a local file (``jsonl``, ``parquet``, or a glob of them) by its sha256;
- a ``kind: magpie`` file by its sha256 once the data stage has written it (before any
  prompt is read; ``peagle.data.synthesize``). Until then it is ``NOT_WRITTEN``: what the
  target will write is decided by the source's own config, which the data config hash
  holds, and the dataset records the file it then read;
- a hub set (``kind: hf``) by name, subset and split at the commit its ``main`` names,
  resolved once per build (``hub_commits``) and read at that commit; offline, the commit of
  the cached copy; by name alone when neither tells it.

A local path that does not exist is an error naming the source (``peagle.data.prompts.source_files``),
never a hub dataset: hub sets are named by ``kind: hf``.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from peagle.config import PromptSource, resolve_repo_path
from peagle.data.prompts import source_files, source_label
from peagle.fileio import sha256_file

log = logging.getLogger(__name__)

NOT_WRITTEN = "magpie: not written yet"  # a kind: magpie file the data stage has yet to write
HUB_TIMEOUT_S = 30  # a scheduled run must not hang on an unreachable hub: it falls back to the cache


def hub_commits(sources: list[PromptSource], *, cache_dir: str | Path | None = None) -> dict[str, str | None]:
    """The commit each ``kind: hf`` source's ``main`` names now (None: neither the hub nor the
    cache tells it), by source path."""
    return {src.path: hub_dataset_commit(src.path, cache_dir=cache_dir) for src in sources if src.kind == "hf"}


def hub_dataset_commit(repo_id: str, *, cache_dir: str | Path | None = None) -> str | None:
    """The commit of dataset ``repo_id``'s ``main``: the hub's answer (with the user's token, as
    huggingface_hub finds it), else the snapshot the Hugging Face cache holds (``datasets``
    caches a hub set's files there), else None."""
    from huggingface_hub import HfApi, is_offline_mode, try_to_load_from_cache

    if not is_offline_mode():
        try:
            sha = HfApi().dataset_info(repo_id, timeout=HUB_TIMEOUT_S).sha
            if sha:
                return sha
        except Exception as err:  # offline, gated without a token, 5xx, DNS (httpx errors are no OSError)
            log.info("data: the hub did not tell the commit of dataset %s (%s); trying the cache", repo_id,
                     (str(err).strip().splitlines() or [type(err).__name__])[0][:200])
    cached = try_to_load_from_cache(repo_id, "README.md", cache_dir=cache_dir, repo_type="dataset")  # datasets reads it first
    return Path(cached).parent.name if isinstance(cached, str) else None


def source_digests(sources: list[PromptSource], commits: dict[str, str | None]) -> dict[str, str]:
    """Each source (by its configured path) named by what the data stage reads from it now."""
    return {src.path: source_digest(src, k, commits.get(src.path)) for k, src in enumerate(sources)}


def source_digest(src: PromptSource, index: int = 0, commit: str | None = None) -> str:
    """One source by content: a local file's sha256 (a glob's files: a digest of each one's name
    and sha256), a hub set's name at ``commit``, a magpie file not written yet ``NOT_WRITTEN``."""
    if src.kind == "hf":
        return f"{source_label(src)}@{commit}" if commit else source_label(src)
    path = resolve_repo_path(src.path)
    if src.kind == "magpie" and not path.exists():
        return NOT_WRITTEN
    files = source_files(src, index)
    if files == [path] and path.is_file():
        return sha256_file(path)
    parts = [f"{p.name}:{sha256_file(p)}" for p in files if p.is_file()]  # names, not paths: the same on a worker
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()
