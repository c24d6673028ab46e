"""File primitives every on-disk format shares: content hashes and durable, atomic writes.

Every file or directory that a later step trusts is written next to its final place under a
temporary name (``.<name>.tmp-<pid>-<random>``) and renamed into place when complete, so a
reader or a resumed run sees the old content or the new one, never half of it:

    write_json_atomic(run_dir / "build.json", {"config_hash": h})
    with atomic_open(shard, "wb") as fh:          # streamed writes
        fh.write(blob)
    with atomic_path(head / "model.safetensors") as tmp:   # libraries that take a path
        save_file(tensors, str(tmp))
    with staged_dir(target_dir) as tmp:           # a whole directory at once
        build_into(tmp)

Durable (the default) also fsyncs the data and the directory entry, so the rename survives
a power loss, not only a killed process.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

TMP_MARK = ".tmp-"
OLD_MARK = ".old-"  # publish_dir moves the tree it replaces aside under this mark


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def error_number(err: BaseException) -> int | None:
    """The errno an exception carries, or names in its message (safetensors' Rust writer
    raises "... No space left on device (os error 28)", not an ``OSError``)."""
    if isinstance(err, OSError) and err.errno:
        return err.errno
    found = re.search(r"os error (\d+)", str(err))
    return int(found.group(1)) if found else None


def is_disk_full(err: BaseException) -> bool:
    """An error that means the disk (or the user's quota) is full, whoever raised it."""
    return error_number(err) in DISK_FULL


def json_digest(value, length: int = 16) -> str:
    """The first ``length`` hex digits of the sha256 of ``value`` as canonical JSON (sorted
    keys): every stable key peagle derives (config sections, sample ids, cache keys)."""
    blob = json.dumps(value, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:length]


def sha256_file(path: str | Path, chunk: int = 1 << 24) -> str:
    """Hex sha256 of a file, read in chunks so shards of any size hash in bounded memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


def tree_bytes(root: str | Path) -> int:
    """Bytes of the files under ``root`` now (``du``); a file renamed or deleted while counted, by a
    writer working beside the count, counts as gone."""
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                total += os.stat(os.path.join(folder, name)).st_size
            except FileNotFoundError:
                pass
    return total


def fsync_dir(path: str | Path) -> None:
    """Make a rename inside ``path`` durable (the directory entry, not only the file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | Path) -> None:
    """fsync every file and directory under ``path`` (before it is renamed into place)."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            fsync_file(Path(root) / name)
        fsync_dir(root)


def temp_sibling(path: str | Path, kind: str = "tmp") -> Path:
    """A unique hidden name next to ``path`` (same file system, so the rename is atomic);
    the suffix is kept so libraries that infer a format from it (matplotlib) still do."""
    path = Path(path)
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}{path.suffix}")


def is_temp_name(name: str) -> bool:
    """A leftover of an interrupted atomic write or publish (ours, or an older ``<name>.tmp``)."""
    return (name.startswith(".") and (TMP_MARK in name or OLD_MARK in name)) or name.endswith(".tmp")


@contextmanager
def atomic_path(path: str | Path, *, durable: bool = True) -> Iterator[Path]:
    """Yield a temporary path to write ``path``'s new content to; it replaces ``path`` when the
    block succeeds and is removed when it raises. ``durable=False`` skips the fsyncs (for
    files a crash may lose, as long as no reader sees them half-written)."""
    path = Path(path)
    tmp = temp_sibling(path)
    try:
        yield tmp
        if not tmp.exists():
            raise FileNotFoundError(f"{tmp}: nothing was written for {path}")
        if durable:
            fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


@contextmanager
def atomic_open(path: str | Path, mode: str = "w", *, durable: bool = True, **open_kwargs) -> Iterator[IO]:
    """``open(path, mode)`` whose content appears at ``path`` only once the block succeeds."""
    if not mode.startswith("w"):
        raise ValueError(f"atomic_open writes a whole file; mode {mode!r} is not a write mode")
    if "b" not in mode:
        open_kwargs.setdefault("encoding", "utf-8")
    with atomic_path(path, durable=durable) as tmp, open(tmp, mode, **open_kwargs) as fh:
        yield fh


def write_bytes_atomic(path: str | Path, data: bytes, *, durable: bool = True) -> Path:
    with atomic_open(path, "wb", durable=durable) as fh:
        fh.write(data)
    return Path(path)


def write_text_atomic(path: str | Path, text: str, *, durable: bool = True) -> Path:
    with atomic_open(path, "w", durable=durable) as fh:
        fh.write(text)
    return Path(path)


def write_json_atomic(path: str | Path, obj: Any, *, indent: int | None = 2, durable: bool = True, **dump_kwargs) -> Path:
    with atomic_open(path, "w", durable=durable) as fh:
        json.dump(obj, fh, indent=indent, **dump_kwargs)
    return Path(path)


def publish_dir(src: str | Path, dst: str | Path, *, overwrite: bool = True) -> Path:
    """Move the finished directory ``src`` to ``dst`` (same file system). An existing ``dst`` is
    moved aside first and deleted after, so ``dst`` is always a whole old or a whole new tree."""
    src, dst = Path(src), Path(dst)
    fsync_tree(src)
    if dst.exists():
        if not overwrite:
            raise FileExistsError(f"{dst} already exists; pass overwrite=True or choose another directory")
        old = temp_sibling(dst, "old")
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)
    fsync_dir(dst.parent)
    return dst


@contextmanager
def staged_dir(dst: str | Path, *, overwrite: bool = True) -> Iterator[Path]:
    """Yield an empty directory next to ``dst`` to build into; published as ``dst`` when the
    block succeeds (``publish_dir``), deleted when it raises."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(dst)
    tmp.mkdir()
    try:
        yield tmp
        publish_dir(tmp, dst, overwrite=overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
