"""File primitives every on-disk format shares: content hashes and durable renames."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def sha256_file(path: str | Path, chunk: int = 1 << 24) -> str:
    """Hex sha256 of a file, read in chunks so shards of any size hash in bounded memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(path: str | Path) -> None:
    """Make a rename inside ``path`` durable (the directory entry, not only the file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
