"""Shard store: read throughput against a raw file read, and bytes per token per dtype.

1. Read throughput of one split (page cache warm for all, so this is the decode cost,
   not the disk): a raw sequential read of the shard files' bytes vs ``ShardReader``
   turning every sample into tensors (float32 hidden states): without any check; with a
   full sha256 of every shard (``verify="full"``: what a reader does the first time it
   sees a shard); and verified once per file identity (``verify=True``, the default: a shard
   whose size/mtime/ctime/inode match a passing check is not re-hashed).
2. The same samples re-stored with ``ShardWriter`` as float32 / bfloat16 / float16 /
   float8: bytes per token on disk against the raw hidden-state tensor bytes per token
   (``layers x hidden x itemsize``), the store's own ``bytes_per_token`` estimate, and
   ``ShardReader`` throughput per dtype.

    .venv/bin/python bench/data_loader.py [--split-dir DIR] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from peagle.layout import MANIFEST_FILE, RunLayout

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_common import render_saved, report, started  # noqa: E402

NAME = "data_loader"
DTYPES = ("float32", "bfloat16", "float16", "float8")
VERIFY_MODES = {  # ShardReader(verify=...) -> row label
    False: "no sha256",
    "full": "full sha256 every open",
    True: "sha256 once per file identity",
}


def shard_files(split_dir: Path) -> list[Path]:
    manifest = json.loads((split_dir / MANIFEST_FILE).read_text())
    return [split_dir / s["file"] for s in manifest["shards"]]


def raw_read(files: list[Path], chunk: int = 1 << 24) -> int:
    """Plain sequential read of every byte: the floor for any loader."""
    total = 0
    for path in files:
        with open(path, "rb") as fh:
            while block := fh.read(chunk):
                total += len(block)
    return total


def reader_pass(split_dir: Path, verify: bool | str) -> int:
    """Every sample as tensors through a fresh reader (``verify``: ShardReader's)."""
    from peagle.data.store import ShardReader

    tokens = 0
    for sample in ShardReader(split_dir, verify=verify):
        tokens += sample.hidden.shape[0]
    return tokens


def with_threads(threads: int, fn, *args):
    """``fn`` with torch's intra-op threads set to ``threads`` (DataLoader workers use 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(before)


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_medians(jobs: dict, repeats: int) -> dict[str, float]:
    """Median seconds per job, the jobs taking turns in every repeat (shared cores: same load for all)."""
    times = {name: [] for name in jobs}
    for _ in range(repeats):
        for name, job in jobs.items():
            start = time.perf_counter()
            job()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def split_bytes(split_dir: Path) -> int:
    return sum(p.stat().st_size for p in shard_files(split_dir))


def read_throughput(split_dir: Path, repeats: int) -> dict:
    from peagle.data.store import ShardReader

    files = shard_files(split_dir)
    reader = ShardReader(split_dir, verify=False)
    num_samples, num_tokens, size = len(reader), reader.num_tokens, split_bytes(split_dir)
    raw_read(files)  # page cache warm for every variant
    reader_pass(split_dir, "full")  # records every shard's identity (the split is older than the racy window)
    jobs = {"raw file read": lambda: raw_read(files)}
    for threads in sorted({torch.get_num_threads(), 1}, reverse=True):
        for verify, label in VERIFY_MODES.items():
            name = f"ShardReader, {label}, {threads} torch thread(s)"
            jobs[name] = lambda v=verify, t=threads: with_threads(t, reader_pass, split_dir, v)
    rows = interleaved_medians(jobs, repeats)
    raw_s = rows["raw file read"]
    return {
        "split_dir": str(split_dir),
        "storage_dtype": reader.storage_dtype,
        "num_samples": num_samples,
        "num_tokens": num_tokens,
        "bytes": size,
        "rows": {
            name: {
                "seconds": s,
                "samples_per_s": num_samples / s,
                "tokens_per_s": num_tokens / s,
                "mib_per_s": size / s / 2**20,
                "throughput_vs_raw": raw_s / s,
            }
            for name, s in rows.items()
        },
    }


def restore_as(src_split: Path, dst_split: Path, storage_dtype: str) -> dict:
    """Write the source split's samples again with another storage dtype."""
    from peagle.data.store import ShardReader, ShardWriter

    reader = ShardReader(src_split, verify=True)
    m = reader.manifest
    shutil.rmtree(dst_split, ignore_errors=True)
    with ShardWriter(dst_split, m["layer_ids"], m["hidden_size"], storage_dtype, 262_144) as writer:
        for s in reader:
            writer.add(s.id, s.token_ids, s.loss_mask, s.hidden)
    return writer.manifest


def bytes_per_token_table(src_split: Path, work: Path, repeats: int) -> dict:
    from peagle.data.store import STORAGE_DTYPES, bytes_per_token

    out = {}
    for dtype in DTYPES:
        split = work / dtype
        m = restore_as(src_split, split, dtype)
        nl, h, tokens = len(m["layer_ids"]), m["hidden_size"], m["num_tokens"]
        raw = nl * h * torch.empty((), dtype=STORAGE_DTYPES[dtype]).element_size()
        on_disk = split_bytes(split) / tokens
        reader_s = median_seconds(lambda split=split: reader_pass(split, verify=False), repeats)
        reader_1t_s = median_seconds(lambda split=split: with_threads(1, reader_pass, split, False), repeats)
        out[dtype] = {
            "num_tokens": tokens,
            "file_bytes": split_bytes(split),
            "bytes_per_token_on_disk": on_disk,
            "raw_hidden_bytes_per_token": raw,
            "on_disk_over_raw": on_disk / raw,
            "estimate_bytes_per_token": bytes_per_token(nl, h, dtype),
            "reader_tokens_per_s": tokens / reader_s,
            "reader_tokens_per_s_1_thread": tokens / reader_1t_s,
        }
    base = out["bfloat16"]["bytes_per_token_on_disk"]
    for row in out.values():
        row["on_disk_vs_bfloat16"] = row["bytes_per_token_on_disk"] / base
    return out


def tables(result: dict) -> list:
    r = result["read"]
    read_rows = [[name, f"{row['seconds']:.3f}", f"{row['samples_per_s']:.0f}", f"{row['tokens_per_s']:.0f}",
                  f"{row['mib_per_s']:.0f}", f"{row['throughput_vs_raw']:.4f}"] for name, row in r["rows"].items()]
    size_rows = [[dtype, f"{row['bytes_per_token_on_disk']:.1f}", str(row["raw_hidden_bytes_per_token"]),
                  f"{row['on_disk_over_raw']:.3f}", f"{row['on_disk_vs_bfloat16']:.3f}",
                  str(row["estimate_bytes_per_token"]), f"{row['reader_tokens_per_s']:.0f}",
                  f"{row['reader_tokens_per_s_1_thread']:.0f}"]
                 for dtype, row in result["bytes_per_token"].items()]
    return [
        (f"Read throughput: {r['num_samples']} samples / {r['num_tokens']} tokens / {r['bytes'] / 2**20:.1f} MiB "
         f"({r['storage_dtype']}), page cache warm, median of {result['repeats']} (paths interleaved)",
         ["path", "s", "samples/s", "tokens/s", "MiB/s", "x raw read"], read_rows),
        ("Bytes per token on disk: the same samples stored in each dtype",
         ["dtype", "on disk B/tok", "raw hidden B/tok", "disk / raw", "x bfloat16", "estimate B/tok",
          f"reader tok/s ({result['torch_threads']} thr)",
          "reader tok/s (1 thr)"],
         size_rows),
    ]


def notes(result: dict) -> list[str]:
    r = result["read"]
    return [
        f"split: {r['split_dir']} ({r['storage_dtype']}); ShardReader yields float32 hidden [n, layers, H], "
        "int64 token ids, bool mask per sample",
        "raw hidden B/tok = layers x hidden x itemsize; on disk adds 4 B token id + 1 B mask per token, "
        "float8 adds 4 B scale per layer, plus the shard header",
        "reader tok/s per dtype: no sha256, same samples; float32 needs no conversion",
        "torch threads: the process default and 1 (what DataLoader workers use); on these shared, "
        "oversubscribed cores the per-sample dtype conversion with >1 OpenMP thread is far slower",
        "sha256 once per file identity: each shard was fully hashed once before timing (its size, mtime, ctime, "
        "inode and device recorded in peagle's cache); any write, touch or replacement changes the identity and "
        "brings the full hash back (peagle.data.store.VerifiedShards)",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split-dir", default=None, help="default: the demo run's train split")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--render-only", action="store_true", help="re-print results/data_loader.json")
    args = parser.parse_args()
    if args.render_only:
        render_saved(NAME, tables, notes)
        return

    from peagle.paths import configure_environment, peagle_home

    configure_environment()
    split_dir = Path(args.split_dir) if args.split_dir else RunLayout(peagle_home() / "runs" / "demo").data.train
    work = peagle_home() / "bench" / "data_loader"
    try:
        result = {
            "benchmark": NAME,
            **started(),
            "repeats": args.repeats,
            "torch_threads": torch.get_num_threads(),
            "read": read_throughput(split_dir, args.repeats),
            "bytes_per_token": bytes_per_token_table(split_dir, work, args.repeats),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(NAME, result, tables(result), notes(result))


if __name__ == "__main__":
    main()
