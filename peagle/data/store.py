"""The hidden-state shard store: large safetensors shards plus one manifest per split.

Layout of ``<split_dir>``::

    shard-00000.safetensors   hidden [T, nl, Ht] (storage dtype), token_ids int32 [T],
                              loss_mask uint8 [T], seq_offsets int64 [N+1],
                              scales float32 [T, nl] (float8 only); sample ids in metadata
    manifest.json             format version, layer ids, dtype, caller's meta (config hash,
                              target), per-shard {file, sha256, samples, tokens, bytes}, totals

Crash safety: a shard is written to a temp file, fsynced, then renamed; the manifest is
rewritten the same way after every shard. Readers only trust shards the manifest lists,
so a ``kill -9`` at any moment loses at most the unflushed buffer (at most
``shard_max_tokens`` tokens or ``max_buffer_s`` seconds of samples), and a rerun of the
writer (``done_ids()``) continues with no duplicate and no missing sample.

Soundness: ``verify_split`` checks every shard of a split against its manifest (once per
file identity, ``VerifiedShards``); ``drop_shards`` takes corrupt ones out of the
manifest, so that the writer's next run stores their samples again (``peagle data
--repair``).
"""

from __future__ import annotations

import bisect
import fcntl
import hashlib
import json
import logging
import os
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from peagle.data.errors import CorruptShardError, DiskSpaceError
from peagle.fileio import atomic_open, is_temp_name, json_digest, sha256_file, write_json_atomic
from peagle.layout import MANIFEST_FILE
from peagle.paths import peagle_home

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = MANIFEST_FILE  # named in peagle.layout
FP8_MAX = 448.0  # largest finite torch.float8_e4m3fn
# A shard whose mtime/ctime is this close to the check is not recorded ("racy" in git's
# sense): on a coarse-timestamp file system a same-tick rewrite would keep its identity.
RACY_WINDOW_NS = 2_000_000_000
SHARD_PREFIX = "shard-"
SHARD_SUFFIX = ".safetensors"
REPAIR_COMMAND = "peagle data CONFIG --repair"  # what every corrupt-shard message points at

STORAGE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8": torch.float8_e4m3fn,
}
_SAFETENSORS_DTYPE = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.uint8: "U8",
}


@dataclass
class Sample:
    token_ids: torch.Tensor  # int64 [n]
    loss_mask: torch.Tensor  # bool [n]; True on assistant tokens
    hidden: torch.Tensor  # float32 [n, nl, Ht]; layers = manifest["layer_ids"]
    id: str = ""


# ----------------------------------------------------------------------------- sizes


def bytes_per_token(num_layers: int, hidden_size: int, storage_dtype: str) -> int:
    """Bytes one token costs on disk: hidden states + token id + mask (+ fp8 scales)."""
    itemsize = torch.empty((), dtype=STORAGE_DTYPES[storage_dtype]).element_size()
    scales = 4 * num_layers if storage_dtype == "float8" else 0
    return num_layers * hidden_size * itemsize + 4 + 1 + scales


def estimate_bytes(num_tokens: int, num_layers: int, hidden_size: int, storage_dtype: str) -> int:
    """Disk needed for ``num_tokens`` tokens, with 1% (and 1 MiB) for headers and manifests."""
    raw = num_tokens * bytes_per_token(num_layers, hidden_size, storage_dtype)
    return int(raw * 1.01) + (1 << 20)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def existing_ancestor(path: str | Path) -> Path:
    """``path``, or its nearest ancestor that exists (where a directory about to be made lives)."""
    probe = Path(path).resolve()
    while not probe.exists():
        probe = probe.parent
    return probe


def free_bytes(path: str | Path) -> int:
    """Free bytes (for this user) on the file system that holds, or will hold, ``path``."""
    return shutil.disk_usage(existing_ancestor(path)).free


def mount_point(path: str | Path) -> Path:
    """The mount point of the file system holding ``path``: the disk a message names."""
    probe = existing_ancestor(path)
    while not os.path.ismount(probe):
        probe = probe.parent
    return probe


DATA_SPACE_FIXES = (
    "Set data.hidden_states: streamed (the train split keeps its tokens only; its hidden states are extracted "
    "while training, into a spool of data.spool_gib), free some space, point PEAGLE_HOME or `workdir` at a larger "
    "disk, lower data.max_samples / data.max_seq_len, or use a smaller data.storage_dtype (float8 halves "
    "bfloat16); --force writes anyway."
)


def check_free_space(path: str | Path, needed: int, force: bool = False, *, what: str = "this run",
                     fixes: str = DATA_SPACE_FIXES) -> int:
    """Refuse (``DiskSpaceError``) when the disk holding ``path`` has less than ``needed`` free.

    Returns the free bytes. With ``force`` a shortfall only warns, for callers that know
    better (e.g. a filesystem that reports free space wrongly). ``what`` says what needs
    the space (a breakdown helps the user pick the fix); ``fixes`` how to make room.
    """
    probe = existing_ancestor(path)
    free = free_bytes(probe)
    if needed > free:
        msg = (
            f"not enough disk space at {probe} (on {mount_point(probe)}): {what} needs {format_bytes(needed)} "
            f"but only {format_bytes(free)} is free. {fixes}"
        )
        if not force:
            raise DiskSpaceError(msg)
        log.warning(msg)
    return free


# ----------------------------------------------------------------------------- safetensors


def _to_bytes(t: torch.Tensor):
    """A zero-copy little-endian byte view of a tensor (numpy cannot hold bf16/fp8 itself)."""
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().data


def _write_safetensors(path: Path, tensors: dict[str, list[torch.Tensor]], metadata: dict[str, str]) -> str:
    """Write chunked tensors (concatenated along dim 0) as one safetensors file; return sha256.

    Writing the chunks straight to the file avoids ``torch.cat``, so peak memory stays at
    one shard instead of two. The file appears at ``path`` only when complete (``atomic_open``).
    """
    header, offset = {}, 0
    for name, chunks in tensors.items():
        rows = sum(c.shape[0] for c in chunks)
        nbytes = sum(c.numel() * c.element_size() for c in chunks)
        header[name] = {
            "dtype": _SAFETENSORS_DTYPE[chunks[0].dtype],
            "shape": [rows, *chunks[0].shape[1:]],
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned, as safetensors writes it
    digest = hashlib.sha256()
    with atomic_open(path, "wb") as fh:
        for piece in (struct.pack("<Q", len(blob)), blob):
            fh.write(piece)
            digest.update(piece)
        for chunks in tensors.values():
            for c in chunks:
                data = _to_bytes(c)
                fh.write(data)
                digest.update(data)
    return digest.hexdigest()


def _shard_sample_ids(path: Path) -> list[str]:
    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["sample_ids"])


def quantize_fp8(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 e4m3 with one float32 scale per token and layer (absmax over the hidden dim)."""
    lo, hi = torch.aminmax(hidden.detach(), dim=-1)  # NaN/inf propagate into the scales
    scales = (torch.maximum(-lo, hi).float() / FP8_MAX).clamp_min(1e-12)
    return (hidden.detach() / scales.unsqueeze(-1)).to(torch.float8_e4m3fn), scales


def _check_representable(sample_id: str, hidden: torch.Tensor, storage_dtype: str) -> None:
    """NaN/inf or values the storage dtype cannot hold (one min/max pass; NaN propagates)."""
    if hidden.numel() == 0:  # a token-only sample (a streamed split)
        return
    lo, hi = (float(v) for v in torch.aminmax(hidden.detach()))
    limit = torch.finfo(STORAGE_DTYPES[storage_dtype]).max
    if not (-limit <= lo and hi <= limit):
        raise ValueError(
            f"sample {sample_id!r}: hidden states in [{lo}, {hi}] are not finite in {storage_dtype} "
            "(float16 tops out at 65504: use bfloat16 or float8)"
        )


# ----------------------------------------------------------------------------- writer


class ShardWriter:
    """Buffers samples and writes them as large shards; resumable after any crash.

    ``meta`` (config hash, target id/revision, ...) goes into the manifest; reopening a
    split whose manifest disagrees on meta, layers, width or dtype is an error, so shards
    from two different configurations never mix. One writer per split at a time (a lock
    file enforces it; the OS drops the lock when a killed writer dies).
    """

    def __init__(
        self,
        split_dir: str | Path,
        layer_ids: list[int],
        hidden_size: int,
        storage_dtype: str,
        shard_max_tokens: int,
        meta: dict | None = None,
        max_buffer_s: float | None = None,
    ):
        if storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage dtype {storage_dtype!r} is not one of {sorted(STORAGE_DTYPES)}")
        self.split_dir = Path(split_dir)
        self.split_dir.mkdir(parents=True, exist_ok=True)
        self.layer_ids = [int(i) for i in layer_ids]
        self.hidden_size = int(hidden_size)
        self.storage_dtype = storage_dtype
        self.shard_max_tokens = int(shard_max_tokens)
        self.meta = dict(meta or {})
        self.max_buffer_s = max_buffer_s
        self._lock = self._acquire_lock()
        self._manifest = self._load_or_start_manifest()
        self._remove_unlisted_files()
        self._done = {sid for s in self._manifest["shards"] for sid in _shard_sample_ids(self.split_dir / s["file"])}
        self._buffer: list[tuple[str, dict[str, torch.Tensor]]] = []
        self._buffer_ids: set[str] = set()
        self._buffered_tokens = 0
        self._buffer_since = time.monotonic()

    # -- opening

    def _acquire_lock(self):
        fh = open(self.split_dir / ".lock", "w")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            raise RuntimeError(f"{self.split_dir}: another process is writing this split") from None
        return fh

    def _fresh_manifest(self) -> dict:
        reserved = {"format_version", "layer_ids", "hidden_size", "storage_dtype", "shards",
                    "num_samples", "num_tokens", "bytes", "complete"}
        clash = reserved & self.meta.keys()
        if clash:
            raise ValueError(f"ShardWriter meta uses reserved manifest keys {sorted(clash)}")
        return {
            "format_version": FORMAT_VERSION,
            **self.meta,
            "layer_ids": self.layer_ids,
            "hidden_size": self.hidden_size,
            "storage_dtype": self.storage_dtype,
            "shards": [],
            "num_samples": 0,
            "num_tokens": 0,
            "bytes": 0,
            "complete": False,
        }

    def _load_or_start_manifest(self) -> dict:
        path = self.split_dir / MANIFEST
        fresh = self._fresh_manifest()
        if not path.exists():
            return fresh
        old = json.loads(path.read_text())
        diff = self._settings_diff(old, fresh)
        if diff:
            detail = ", ".join(f"{k}: on disk {a!r}, now {b!r}" for k, (a, b) in diff.items())
            raise ValueError(
                f"{self.split_dir}: existing shards were written with different settings ({detail}); "
                "delete the directory (or rerun with --force) to rebuild it"
            )
        old["complete"] = False
        return old

    def _settings_diff(self, other: dict, mine: dict) -> dict[str, tuple]:
        """``{key: (other's, mine)}`` for each setting two manifests must share (format, layers,
        width, dtype, the writer's meta) where they differ: shards of both never mix otherwise."""
        keys = ["format_version", "layer_ids", "hidden_size", "storage_dtype", *self.meta]
        return {k: (other.get(k), mine[k]) for k in keys if other.get(k) != mine[k]}

    def _remove_unlisted_files(self) -> None:
        """Temp files and shards a killed writer renamed but never listed: not trusted, not kept."""
        listed = {s["file"] for s in self._manifest["shards"]}
        for p in self.split_dir.iterdir():
            if is_temp_name(p.name) or (p.name.startswith(SHARD_PREFIX) and p.name not in listed):
                p.unlink()

    # -- writing

    def done_ids(self) -> set[str]:
        """Ids already in flushed shards or the buffer: a resumed run skips these."""
        return self._done | self._buffer_ids

    def add(self, sample_id: str, token_ids, loss_mask, hidden: torch.Tensor) -> None:
        """Queue one sample; write a shard when the buffer would exceed ``shard_max_tokens``
        or its oldest sample has waited ``max_buffer_s`` (what a crash could lose)."""
        sample_id = str(sample_id)
        if sample_id in self._done or sample_id in self._buffer_ids:
            raise ValueError(f"sample {sample_id!r} is already in {self.split_dir}")
        tensors = self._encode(sample_id, token_ids, loss_mask, hidden)
        n = tensors["token_ids"].shape[0]
        if self._buffer and self._buffered_tokens + n > self.shard_max_tokens:
            self.flush()
        if not self._buffer:
            self._buffer_since = time.monotonic()
        self._buffer.append((sample_id, tensors))
        self._buffer_ids.add(sample_id)
        self._buffered_tokens += n
        waited = time.monotonic() - self._buffer_since
        if self._buffered_tokens >= self.shard_max_tokens or (self.max_buffer_s is not None and waited >= self.max_buffer_s):
            self.flush()

    def _encode(self, sample_id, token_ids, loss_mask, hidden) -> dict[str, torch.Tensor]:
        token_ids = torch.as_tensor(token_ids).reshape(-1)
        loss_mask = torch.as_tensor(loss_mask).reshape(-1)
        n, nl, ht = token_ids.shape[0], len(self.layer_ids), self.hidden_size
        if n == 0 or loss_mask.shape[0] != n or tuple(hidden.shape) != (n, nl, ht):
            raise ValueError(
                f"sample {sample_id!r}: expected {n} token ids, {n} mask values and hidden "
                f"[{n}, {nl}, {ht}]; got mask [{loss_mask.shape[0]}] and hidden {list(hidden.shape)}"
            )
        if not hidden.dtype.is_floating_point:
            raise ValueError(f"sample {sample_id!r}: hidden states must be floating point, got {hidden.dtype}")
        out = {"token_ids": token_ids.to(torch.int32), "loss_mask": loss_mask.to(torch.uint8)}
        if self.storage_dtype == "float8":
            out["hidden"], out["scales"] = quantize_fp8(hidden)
            _check_representable(sample_id, out["scales"], "float32")
        else:
            _check_representable(sample_id, hidden, self.storage_dtype)
            out["hidden"] = hidden.detach().to(STORAGE_DTYPES[self.storage_dtype]).contiguous()
        return out

    def flush(self) -> None:
        """Write the buffer as the next shard, then the manifest (both atomically)."""
        if not self._buffer:
            return
        ids = [sid for sid, _ in self._buffer]
        lengths = torch.tensor([t["token_ids"].shape[0] for _, t in self._buffer], dtype=torch.int64)
        names = ["hidden", "token_ids", "loss_mask"] + (["scales"] if self.storage_dtype == "float8" else [])
        tensors = {name: [t[name] for _, t in self._buffer] for name in names}
        tensors["seq_offsets"] = [torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])]
        name = self._next_shard_name()
        path = self.split_dir / name
        sha = _write_safetensors(path, tensors, {"sample_ids": json.dumps(ids), "format_version": str(FORMAT_VERSION)})
        size = path.stat().st_size
        m = self._manifest
        m["shards"].append(
            {"file": name, "sha256": sha, "samples": len(ids), "tokens": int(lengths.sum()), "bytes": size}
        )
        m["num_samples"] += len(ids)
        m["num_tokens"] += int(lengths.sum())
        m["bytes"] += size
        write_json_atomic(self.split_dir / MANIFEST, m, indent=1)
        self._done.update(ids)
        self._buffer, self._buffer_ids, self._buffered_tokens = [], set(), 0

    def _next_shard_name(self) -> str:
        """One past the highest listed shard number (a repair leaves gaps; names are never reused)."""
        numbers = [int(s["file"][len(SHARD_PREFIX):-len(SHARD_SUFFIX)]) for s in self._manifest["shards"]]
        return f"{SHARD_PREFIX}{max(numbers, default=-1) + 1:05d}{SHARD_SUFFIX}"

    def adopt(self, other_dir: str | Path) -> int:
        """Move the shards another writer of the same settings listed (a part of the data stage
        built on another host) into this split, after its own; returns the samples taken.

        A shard whose samples this split already holds is skipped (an adoption a crash cut
        short, rerun); one that holds only some of them is an error: a sample is never stored
        twice. Shards are renamed, not copied: the other split is on the same volume."""
        other_dir = Path(other_dir)
        path = other_dir / MANIFEST
        if not path.exists():
            return 0
        other = json.loads(path.read_text())
        diff = self._settings_diff(other, self._manifest)
        if diff:
            detail = ", ".join(f"{k}: {a!r} there, {b!r} here" for k, (a, b) in diff.items())
            raise ValueError(f"{other_dir}: its shards were written with other settings than {self.split_dir}'s "
                             f"({detail}); delete it and build that part again")
        self.flush()
        taken = 0
        for entry in other["shards"]:
            source = other_dir / entry["file"]
            held = self.done_ids()
            if not source.exists():  # moved by an adoption a crash cut short: its samples are extracted again
                log.warning("%s: listed but gone; its %d samples are extracted again", source, entry["samples"])
                continue
            ids = _shard_sample_ids(source)
            if all(sid in held for sid in ids):
                continue
            if any(sid in held for sid in ids):
                raise ValueError(f"{source} holds samples {self.split_dir} already holds, and others: a sample is "
                                 f"never stored twice; delete {other_dir} and build that part again")
            name = self._next_shard_name()
            os.replace(source, self.split_dir / name)
            m = self._manifest
            m["shards"].append({**entry, "file": name})
            m["num_samples"] += entry["samples"]
            m["num_tokens"] += entry["tokens"]
            m["bytes"] += entry["bytes"]
            write_json_atomic(self.split_dir / MANIFEST, m, indent=1)
            self._done.update(ids)
            taken += entry["samples"]
        return taken

    @property
    def num_buffered(self) -> int:
        """Samples added but not yet in a shard."""
        return len(self._buffer)

    def close(self) -> dict:
        """Flush the rest and mark the split complete; returns the manifest."""
        self.flush()
        self._manifest["complete"] = True
        write_json_atomic(self.split_dir / MANIFEST, self._manifest, indent=1)
        if self._lock is not None:
            self._lock.close()
            self._lock = None
        return self._manifest

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.close()
            return
        try:  # the buffer holds only whole, checked samples: keep them, but do not mark complete
            self.flush()
        except Exception as err:  # noqa: BLE001 - the error that ended the block is the one to report
            log.warning("%s: %d buffered sample(s) not written (%s: %s); a rerun extracts them again",
                        self.split_dir, len(self._buffer), type(err).__name__, err)
        finally:
            if self._lock is not None:
                self._lock.close()
                self._lock = None

    @property
    def manifest(self) -> dict:
        return self._manifest


# ----------------------------------------------------------------------------- reader


def file_identity(path: Path) -> dict[str, int]:
    """What changes whenever a file's bytes may have: size, mtime, ctime, inode, device.

    ``ctime`` moves on every write and on every ``utime``, and cannot be set back by a
    user; a replaced file (rename, copy) has another inode.
    """
    st = os.stat(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
            "ino": st.st_ino, "dev": st.st_dev}


def corrupt_shard_message(shard: Path, problem: str) -> str:
    return (
        f"{shard} is corrupt ({problem}; checked against {shard.parent / MANIFEST}): `{REPAIR_COMMAND}` "
        "extracts its samples again, or restore the file"
    )


def verified_record(split_dir: Path) -> Path:
    """Where the identities of a split's verified shards are kept: peagle's cache, one file
    per split directory (the dataset itself is never written by readers, and may be read-only)."""
    key = json_digest(str(Path(split_dir).resolve()), 24)
    return peagle_home() / "cache" / "verified-shards" / f"{key}.json"


class VerifiedShards:
    """Verify a shard's sha256 once per file identity (recorded in ``verified_record``).

    A full sha256 check that passes records the shard's identity (``file_identity``) with
    the sha256 it matched; later opens whose identity and manifest sha256 are unchanged
    trust the file without re-reading it. Any write, truncation, replacement or ``touch``
    changes the identity, so the next open hashes the file again. Not covered: bytes that
    change on the medium with no file-system write (silent bit rot); ``ShardReader(...,
    verify="full")`` re-hashes every shard. The record is a cache: when it cannot be
    written or is lost, shards are simply hashed again.
    """

    def __init__(self, split_dir: Path, full: bool = False, remember: bool = True):
        self.path = verified_record(split_dir)
        self.full = full
        self.remember = remember  # False: a split read once and deleted (a spool chunk) leaves no record
        self._known: dict | None = None  # the record as read once (a store of many shards reads it once)

    def check(self, shard: Path, entry: dict) -> None:
        """Raise ``CorruptShardError`` unless ``shard`` is the file the manifest lists."""
        problem = self.problem(shard, entry)
        if problem is not None:
            raise CorruptShardError(corrupt_shard_message(shard, problem))

    def is_recorded(self, shard: Path, entry: dict) -> bool:
        """``shard`` passed a check and has not changed since (no need to hash it)."""
        try:
            identity = file_identity(shard)
        except FileNotFoundError:
            return False
        return not self.full and self._recorded(shard.name) == {**identity, "sha256": entry["sha256"]}

    def problem(self, shard: Path, entry: dict) -> str | None:
        """What is wrong with ``shard`` against its manifest entry, or None when it is sound."""
        try:
            before = file_identity(shard)
        except FileNotFoundError:
            return "missing"
        if not self.full and self._recorded(shard.name) == {**before, "sha256": entry["sha256"]}:
            return None
        if before["size"] != entry["bytes"]:
            return f"{before['size']} bytes on disk, {entry['bytes']} expected"
        if sha256_file(shard) != entry["sha256"]:
            return "its sha256 does not match the manifest's"
        changed_late = time.time_ns() - max(before["mtime_ns"], before["ctime_ns"]) < RACY_WINDOW_NS
        if self.remember and file_identity(shard) == before and not changed_late:
            self._record(shard.name, {**before, "sha256": entry["sha256"]})
        return None

    def _recorded(self, name: str) -> dict | None:
        if self._known is None:
            self._known = self._records()
        return self._known.get(name)

    def _records(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def _record(self, name: str, identity: dict) -> None:
        records = self._records()  # read again: other readers (ranks) may have recorded shards since
        records[name] = identity
        self._known = records
        try:  # a lost record only costs a re-hash: no fsync
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.path, records, indent=1, durable=False)
        except OSError as err:
            log.debug("cannot record verified shard %s in %s: %s", name, self.path, err)


class ShardReader:
    """Random access to the samples of one split, memory-mapped shard by shard.

    A shard is verified against the manifest's sha256 the first time it is opened, once
    per file identity (``VerifiedShards``: a shard unchanged since a passing check is not
    re-hashed); ``verify="full"`` re-hashes regardless, ``verify=False`` skips the check
    (e.g. counting tokens for the vocabulary right after the writer produced the split).
    """

    def __init__(self, split_dir: str | Path, verify: bool | str = True, *, remember_checks: bool = True):
        self.split_dir = Path(split_dir)
        path = self.split_dir / MANIFEST
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: build the dataset first (`peagle data`)")
        self.manifest = json.loads(path.read_text())
        if self.manifest.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{path}: shard format version {self.manifest.get('format_version')} is not "
                f"{FORMAT_VERSION}; rebuild the dataset with this version of peagle"
            )
        if verify not in (True, False, "full"):
            raise ValueError(f"ShardReader verify must be True, False or 'full', got {verify!r}")
        self.verify = verify
        self.layer_ids = self.manifest["layer_ids"]
        self.storage_dtype = self.manifest["storage_dtype"]
        self._starts = [0]
        for s in self.manifest["shards"]:
            self._starts.append(self._starts[-1] + s["samples"])
        self._open: dict[int, tuple] = {}
        self._verified = VerifiedShards(self.split_dir, full=verify == "full", remember=remember_checks)

    def __getstate__(self):
        # Open shard handles cannot be pickled (DataLoader workers started by spawn); reopen lazily.
        return {**self.__dict__, "_open": {}}

    def __len__(self) -> int:
        return self._starts[-1]

    @property
    def num_tokens(self) -> int:
        return self.manifest["num_tokens"]

    @property
    def num_shards(self) -> int:
        return len(self.manifest["shards"])

    def _shard(self, k: int):
        """(safe_open handle, seq_offsets, sample ids) of shard k, opened and verified once."""
        if k not in self._open:
            entry = self.manifest["shards"][k]
            path = self.split_dir / entry["file"]
            if not path.exists():
                raise CorruptShardError(corrupt_shard_message(path, "listed in the manifest but missing"))
            if self.verify:
                self._verified.check(path, entry)
            try:
                f = safe_open(str(path), framework="pt")
                offsets = f.get_tensor("seq_offsets")
                ids = json.loads(f.metadata()["sample_ids"])
            except Exception as err:  # unreadable header: only possible with verify=False
                raise CorruptShardError(f"{path} cannot be read as a shard: {err}") from None
            self._open[k] = (f, offsets, ids)
        return self._open[k]

    def _locate(self, i: int) -> tuple[int, int]:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        k = bisect.bisect_right(self._starts, i) - 1
        return k, i - self._starts[k]

    def __getitem__(self, i: int) -> Sample:
        k, j = self._locate(i)
        f, offsets, ids = self._shard(k)
        a, b = int(offsets[j]), int(offsets[j + 1])
        hidden = f.get_slice("hidden")[a:b].to(torch.float32)
        if self.storage_dtype == "float8":
            hidden = hidden * f.get_slice("scales")[a:b].unsqueeze(-1)
        return Sample(
            token_ids=f.get_slice("token_ids")[a:b].to(torch.int64),
            loss_mask=f.get_slice("loss_mask")[a:b].to(torch.bool),
            hidden=hidden,
            id=ids[j],
        )

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def sample_ids(self) -> list[str]:
        return [sid for k in range(self.num_shards) for sid in self._shard(k)[2]]

    def lengths(self) -> list[int]:
        """Token count of every sample, in order (for length-aware batching)."""
        return [int(n) for k in range(self.num_shards) for n in self._shard(k)[1].diff()]

    def iter_tokens(self):
        """(token_ids int64 [T], loss_mask bool [T]) of each whole shard, without hidden states."""
        for k in range(self.num_shards):
            f = self._shard(k)[0]
            yield f.get_tensor("token_ids").to(torch.int64), f.get_tensor("loss_mask").to(torch.bool)


# ----------------------------------------------------------------------------- soundness


@dataclass
class ShardCheck:
    """One shard's verdict (``file`` is the manifest itself when that cannot be read)."""

    split_dir: Path
    file: str
    samples: int
    bytes: int
    problem: str | None = None  # None: sound
    hashed: bool = False  # read and hashed by this check (else trusted from its verification record)

    @property
    def path(self) -> Path:
        return self.split_dir / self.file

    @property
    def ok(self) -> bool:
        return self.problem is None


def _load_manifest(path: Path) -> dict:
    """A manifest file's content; ``ValueError`` saying why it is not one."""
    manifest = json.loads(path.read_text())
    if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), list):
        raise ValueError("it lists no shards")  # noqa: TRY004 - read_manifest reports every ValueError alike
    return manifest


def read_manifest(split_dir: str | Path) -> dict:
    """A split's manifest; ``CorruptShardError`` when it is there but cannot be read."""
    path = Path(split_dir) / MANIFEST
    try:
        return _load_manifest(path)
    except ValueError as err:
        raise CorruptShardError(f"{path} cannot be read ({err}): `{REPAIR_COMMAND}` extracts the split again") from None


def verify_split(split_dir: str | Path, *, full: bool = False) -> list[ShardCheck]:
    """Check every shard the split's manifest lists: once per file identity (``VerifiedShards``:
    a shard unchanged since a passing check is not read again), or all of them with ``full``."""
    split_dir = Path(split_dir)
    try:
        manifest = _load_manifest(split_dir / MANIFEST)
    except ValueError as err:
        return [ShardCheck(split_dir, MANIFEST, 0, 0, problem=f"the manifest cannot be read: {err}")]
    verified = VerifiedShards(split_dir, full=full)
    checks = []
    for entry in manifest["shards"]:
        path = split_dir / entry["file"]
        hashed = not verified.is_recorded(path, entry)
        checks.append(ShardCheck(split_dir, entry["file"], entry["samples"], entry["bytes"],
                                 verified.problem(path, entry), hashed))
    return checks


def unverified_bytes(split_dirs: list[Path]) -> tuple[int, int]:
    """(shards, bytes) a ``verify_split`` of these splits would read: those not verified since
    they last changed (for a progress line before a long hash)."""
    count = size = 0
    for split_dir in split_dirs:
        try:
            manifest = read_manifest(split_dir)
        except CorruptShardError:
            continue
        verified = VerifiedShards(split_dir)
        for entry in manifest["shards"]:
            if not verified.is_recorded(split_dir / entry["file"], entry):
                count, size = count + 1, size + entry["bytes"]
    return count, size


def drop_shards(split_dir: str | Path, files: list[str]) -> int:
    """Take ``files`` out of the split's manifest (marked incomplete) and off the disk, so the
    writer's next run stores their samples again; returns how many samples they held."""
    split_dir = Path(split_dir)
    manifest = read_manifest(split_dir)
    gone = [s for s in manifest["shards"] if s["file"] in set(files)]
    manifest["shards"] = [s for s in manifest["shards"] if s["file"] not in set(files)]
    for key, field_name in (("num_samples", "samples"), ("num_tokens", "tokens"), ("bytes", "bytes")):
        manifest[key] = sum(s[field_name] for s in manifest["shards"])
    manifest["complete"] = False
    write_json_atomic(split_dir / MANIFEST, manifest, indent=1)
    for name in files:
        (split_dir / name).unlink(missing_ok=True)
    return sum(s["samples"] for s in gone)


def stored_samples(split_dir: str | Path) -> int:
    """Samples the split's manifest lists (0 when it has none or cannot be read)."""
    try:
        return int(read_manifest(split_dir).get("num_samples", 0)) if (Path(split_dir) / MANIFEST).exists() else 0
    except CorruptShardError:
        return 0
