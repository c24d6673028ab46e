"""The data benchmarks' own helpers on a tiny random split (no engine, no training)."""

import json

import pytest
import torch

from peagle.data.store import ShardReader, ShardWriter, bytes_per_token
from tests.support.bench import load_bench

LAYERS, HIDDEN = [1, 2, 3], 16



@pytest.fixture
def dataset(tmp_path):
    """A bfloat16 dataset dir with train/eval splits, a head spec and a vocabulary file."""
    g = torch.Generator().manual_seed(0)
    data = tmp_path / "data"
    samples = {}
    for split, count in (("train", 6), ("eval", 2)):
        with ShardWriter(data / "splits" / split, LAYERS, HIDDEN, "bfloat16", 64) as w:
            for i in range(count):
                n = 10 + 7 * i
                ids = torch.randint(0, 100, (n,), generator=g)
                mask = torch.rand(n, generator=g) > 0.3
                w.add(f"{split}-{i}", ids, mask, torch.randn(n, len(LAYERS), HIDDEN, generator=g) * 5)
                samples[f"{split}-{i}"] = ids.tolist()
    (data / "target_facts.json").write_text(json.dumps({"vocab_size": 100}))
    (data / "vocab.safetensors").write_bytes(b"not read by these helpers")
    return data, samples


def test_extraction_bench_sends_the_stored_sequences(dataset):
    data, samples = dataset
    bench = load_bench("data_extraction")
    got = bench.load_sequences(data)
    assert dict(got) == samples
    warm = bench.warmup_sequences(got, vocab_size=100, count=3)
    assert [len(ids) for _, ids in warm] == [len(ids) for _, ids in got[:3]]
    assert all(ids != real for (_, ids), (_, real) in zip(warm, got))


def test_loader_bench_counts_every_byte_and_token(dataset):
    data, _ = dataset
    bench = load_bench("data_loader")
    split = data / "splits" / "train"
    files = bench.shard_files(split)
    assert len(files) > 1  # 64-token shards
    assert bench.raw_read(files) == sum(p.stat().st_size for p in files)
    assert bench.reader_pass(split, verify=True) == ShardReader(split).num_tokens


def test_loader_bench_bytes_per_token_per_dtype(dataset, tmp_path):
    data, _ = dataset
    bench = load_bench("data_loader")
    table = bench.bytes_per_token_table(data / "splits" / "train", tmp_path / "work", repeats=1)
    assert list(table) == ["float32", "bfloat16", "float16", "float8"]
    for dtype, row in table.items():
        assert row["raw_hidden_bytes_per_token"] == len(LAYERS) * HIDDEN * {"float32": 4, "float8": 1}.get(dtype, 2)
        assert row["bytes_per_token_on_disk"] > row["raw_hidden_bytes_per_token"]  # ids, mask, header
        assert row["estimate_bytes_per_token"] == bytes_per_token(len(LAYERS), HIDDEN, dtype)
    assert table["float32"]["file_bytes"] > table["bfloat16"]["file_bytes"] > table["float8"]["file_bytes"]


def test_fp8_copy_keeps_samples_and_reports_small_error(dataset, tmp_path):
    data, _ = dataset
    bench = load_bench("data_fp8_acceptance")
    errors = bench.fp8_copy(data, tmp_path / "fp8")
    assert set(errors) == {f"layer_{k}" for k in LAYERS}
    assert all(0 < e < 0.1 for e in errors.values())  # e4m3: 3 mantissa bits, ~2-4% RMS
    for split in ("train", "eval"):
        a, b = ShardReader(data / "splits" / split), ShardReader(tmp_path / "fp8" / "splits" / split)
        assert b.storage_dtype == "float8" and a.sample_ids() == b.sample_ids()
    assert bench.split_bytes(tmp_path / "fp8") < bench.split_bytes(data)
