"""The shard store: exact round trips, compact files, crash-safe resume, corruption caught."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open

from peagle import fileio
from peagle.data import store
from peagle.data.errors import CorruptShardError, DiskSpaceError
from peagle.data.store import (
    ShardReader,
    ShardWriter,
    bytes_per_token,
    check_free_space,
    estimate_bytes,
)
from peagle.fileio import temp_sibling

LAYERS = [2, 4, 5, 8]


def make_sample(i: int, ht: int = 64):
    """Deterministic sample i: varied length, mask on the second half, Gaussian states."""
    g = torch.Generator().manual_seed(i)
    n = 20 + (i * 37) % 150
    token_ids = torch.randint(0, 1000, (n,), generator=g)
    loss_mask = torch.arange(n) >= n // 2
    hidden = torch.randn(n, len(LAYERS), ht, generator=g) * (1 + i % 5)
    return f"s{i:04d}", token_ids, loss_mask, hidden


def write(split_dir, ids, dtype="bfloat16", shard_max_tokens=1000, ht=64, meta=None):
    with ShardWriter(split_dir, LAYERS, ht, dtype, shard_max_tokens, meta or {"config_hash": "h1"}) as w:
        for i in ids:
            w.add(*make_sample(i, ht))
    return w.manifest


TOLERANCE = {"float32": 0.0, "bfloat16": 2**-8, "float16": 2**-11, "float8": 2**-4}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float8"])
def test_round_trip_every_storage_dtype(tmp_path, dtype):
    manifest = write(tmp_path, range(40), dtype=dtype)
    reader = ShardReader(tmp_path)
    assert len(reader) == 40 and reader.num_shards == len(manifest["shards"]) > 1
    assert reader.num_tokens == sum(make_sample(i)[1].numel() for i in range(40))
    assert reader.lengths() == [make_sample(i)[1].numel() for i in range(40)]
    for i in [0, 7, 39, -1]:
        sid, token_ids, loss_mask, hidden = make_sample(i % 40)
        s = reader[i]
        assert s.id == sid and s.token_ids.dtype == torch.int64 and s.loss_mask.dtype == torch.bool
        assert torch.equal(s.token_ids, token_ids) and torch.equal(s.loss_mask, loss_mask)
        assert s.hidden.dtype == torch.float32 and s.hidden.shape == hidden.shape
        # Relative rounding of the format, plus half the subnormal step (fp8: of the token's scale).
        floor = {"float16": 2**-25, "float8": hidden.abs().amax(-1, keepdim=True) / 448 * 2**-10}.get(dtype, 0)
        assert ((s.hidden - hidden).abs() <= 1.001 * TOLERANCE[dtype] * hidden.abs() + floor).all()
    if dtype == "float8":
        with safe_open(str(tmp_path / "shard-00000.safetensors"), framework="pt") as f:
            assert f.get_slice("hidden").get_dtype() == "F8_E4M3" and f.get_slice("scales").get_shape()[1] == 4


def test_reader_pickles_for_data_loader_workers(tmp_path):
    import pickle

    write(tmp_path, range(5))
    reader = ShardReader(tmp_path)
    reader[0]
    clone = pickle.loads(pickle.dumps(reader))
    assert torch.equal(clone[4].hidden, reader[4].hidden)


def test_shard_layout_matches_the_design(tmp_path):
    manifest = write(tmp_path, range(30), shard_max_tokens=1000)
    assert manifest["complete"] and manifest["config_hash"] == "h1" and manifest["layer_ids"] == LAYERS
    for entry in manifest["shards"]:
        with safe_open(str(tmp_path / entry["file"]), framework="pt") as f:
            t = {k: f.get_tensor(k) for k in f.keys()}
            ids = json.loads(f.metadata()["sample_ids"])
        assert t["token_ids"].dtype == torch.int32 and t["loss_mask"].dtype == torch.uint8
        assert t["seq_offsets"].dtype == torch.int64 and t["seq_offsets"][-1] == entry["tokens"]
        assert len(ids) == entry["samples"] == len(t["seq_offsets"]) - 1
        assert t["hidden"].dtype == torch.bfloat16 and list(t["hidden"].shape) == [entry["tokens"], 4, 64]
        assert entry["tokens"] <= 1000  # no sample here is longer than a shard


def test_disk_size_is_raw_tensor_bytes(tmp_path):
    """Shards are large: headers and manifest cost < 2% over the tensors themselves."""
    manifest = write(tmp_path, range(120), dtype="bfloat16", shard_max_tokens=8192, ht=256)
    tokens = manifest["num_tokens"]
    raw = tokens * (4 * 256 * 2 + 4 + 1) + 8 * (120 + len(manifest["shards"]))
    on_disk = sum(p.stat().st_size for p in tmp_path.iterdir() if p.name != ".lock")
    assert raw <= on_disk <= raw * 1.02
    assert raw <= estimate_bytes(tokens, 4, 256, "bfloat16") <= raw * 1.02 + (1 << 20)
    assert bytes_per_token(4, 4096, "bfloat16") == 32 * 1024 + 5  # 32 KiB/token at Ht = 4096


def test_resume_skips_done_samples_and_refuses_duplicates(tmp_path):
    write(tmp_path, range(25))
    with ShardWriter(tmp_path, LAYERS, 64, "bfloat16", 1000, {"config_hash": "h1"}) as w:
        assert w.done_ids() == {make_sample(i)[0] for i in range(25)}
        with pytest.raises(ValueError, match="already"):
            w.add(*make_sample(3))
        for i in range(50):
            if make_sample(i)[0] not in w.done_ids():
                w.add(*make_sample(i))
    reader = ShardReader(tmp_path)
    assert reader.sample_ids() == [make_sample(i)[0] for i in range(50)]


def test_reopening_with_other_settings_is_refused(tmp_path):
    write(tmp_path, range(5))
    with pytest.raises(ValueError, match="config_hash"):
        ShardWriter(tmp_path, LAYERS, 64, "bfloat16", 1000, {"config_hash": "other"})
    with pytest.raises(ValueError, match="storage_dtype"):
        ShardWriter(tmp_path, LAYERS, 64, "float8", 1000, {"config_hash": "h1"})


def test_bad_samples_are_rejected_with_their_id(tmp_path):
    with ShardWriter(tmp_path, LAYERS, 64, "float16", 1000) as w:
        sid, ids, mask, hidden = make_sample(0)
        with pytest.raises(ValueError, match="s0000.*hidden"):
            w.add(sid, ids, mask, hidden[:, :3])
        with pytest.raises(ValueError, match="float16"):
            w.add(sid, ids, mask, hidden * 1e6)
    with ShardWriter(tmp_path / "fp8", LAYERS, 64, "float8", 1000) as w:
        hidden[3, 1, 5] = float("nan")
        with pytest.raises(ValueError, match="s0000.*not finite"):
            w.add(sid, ids, mask, hidden)


def test_leftovers_of_a_killed_writer_are_ignored_then_removed(tmp_path):
    """A shard renamed but never listed, and temp files: readers skip them, writers delete them."""
    write(tmp_path, range(10))
    listed = {e["file"] for e in json.loads((tmp_path / "manifest.json").read_text())["shards"]}
    orphan = tmp_path / f"shard-{len(listed):05d}.safetensors"
    orphan.write_bytes(b"half a shard")
    (tmp_path / "manifest.json.tmp").write_text("{")  # an older writer's temp name
    half = temp_sibling(tmp_path / orphan.name)
    half.write_bytes(b"half a shard")
    assert len(ShardReader(tmp_path)) == 10
    with ShardWriter(tmp_path, LAYERS, 64, "bfloat16", 1000, {"config_hash": "h1"}) as w:
        assert not orphan.exists() and not (tmp_path / "manifest.json.tmp").exists() and not half.exists()
        w.add(*make_sample(10))
    assert ShardReader(tmp_path).sample_ids() == [make_sample(i)[0] for i in range(11)]


def test_corrupt_shard_is_named(tmp_path):
    write(tmp_path, range(20))
    shard = tmp_path / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    reader = ShardReader(tmp_path)
    reader[0]  # shard 0 is intact
    first_of_shard_1 = json.loads((tmp_path / "manifest.json").read_text())["shards"][0]["samples"]
    with pytest.raises(CorruptShardError, match=r"shard-00001.safetensors is corrupt.*peagle data CONFIG --repair"):
        reader[first_of_shard_1]
    shard.write_bytes(bytes(data[:100]))  # truncated
    with pytest.raises(CorruptShardError, match="shard-00001"):
        ShardReader(tmp_path)[first_of_shard_1]


def test_free_space_check(tmp_path):
    free = check_free_space(tmp_path / "not" / "yet", 1)
    assert free > 0
    with pytest.raises(DiskSpaceError, match=r"needs .* only .* free"):
        check_free_space(tmp_path, free * 1000)
    assert check_free_space(tmp_path, free * 1000, force=True) == pytest.approx(free, rel=0.01)


CHILD = """
import sys
sys.path.insert(0, {tests_dir!r})
from test_store import make_sample, LAYERS
from peagle.data.store import ShardWriter
w = ShardWriter(sys.argv[1], LAYERS, 128, "bfloat16", 2048, {{"config_hash": "h1"}})
done = w.done_ids()
print("ready", flush=True)
for i in range({n}):
    sample = make_sample(i, 128)
    if sample[0] not in done:
        w.add(*sample)
        print(i, flush=True)
w.close()
print("complete", flush=True)
"""


def check_readable(split_dir, n):
    """Every listed sample reads back verified and equal to what was written, once."""
    if not (split_dir / "manifest.json").exists():
        return 0
    reader = ShardReader(split_dir)
    ids = reader.sample_ids()
    assert len(ids) == len(set(ids))
    for i in random.Random(0).sample(range(len(reader)), min(5, len(reader))):
        s = reader[i]
        sid, token_ids, _, hidden = make_sample(int(s.id[1:]), 128)
        assert torch.equal(s.token_ids, token_ids) and torch.equal(s.hidden, hidden.to(torch.bfloat16).float())
    return len(ids)


@pytest.mark.slow
def test_kill_9_at_any_moment_then_resume(tmp_path):
    """SIGKILL a writer at random moments; readers only ever see whole shards; the rerun completes."""
    n, split_dir = 200, tmp_path / "train"
    script = CHILD.format(tests_dir=os.path.dirname(__file__), n=n)
    rng, kills, seen = random.Random(1), 0, []
    for round_ in range(5):  # four rounds killed at a random moment, then one left to finish
        proc = subprocess.Popen([sys.executable, "-c", script, str(split_dir)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        if round_ < 4:  # kill somewhere after a random sample: mid-add, mid-shard or mid-manifest
            target = rng.randrange(n)
            for line in proc.stdout:
                if line.strip() == "complete" or int(line) >= target:
                    break
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
        proc.communicate(timeout=120)
        seen.append(check_readable(split_dir, n))
        if proc.returncode == 0:
            break
    print("samples readable after each round:", seen, "kills:", kills)
    assert kills >= 2, "the writer finished before it could be killed: make it slower"
    assert proc.returncode == 0
    reader = ShardReader(split_dir)
    assert reader.sample_ids() == [make_sample(i)[0] for i in range(n)]  # none missing, none twice
    assert reader.manifest["complete"] and seen == sorted(seen) and seen[-1] == n


def _aged_split(tmp_path, monkeypatch):
    """A written split older than the racy window, and a counter of the sha256 calls the reader makes."""
    monkeypatch.setenv("PEAGLE_HOME", str(tmp_path / "home"))
    write(tmp_path, range(20))
    time.sleep(store.RACY_WINDOW_NS / 1e9 + 0.1)  # files changed within the window are never recorded
    hashed = []

    def counting_sha256(path, *args, **kwargs):
        hashed.append(path.name)
        return fileio.sha256_file(path, *args, **kwargs)

    monkeypatch.setattr(store, "sha256_file", counting_sha256)
    return hashed


def test_verified_shard_is_trusted_until_its_identity_changes(tmp_path, monkeypatch):
    """Each shard is hashed once; a later reader trusts it; a touched file is hashed again."""
    hashed = _aged_split(tmp_path, monkeypatch)
    shards = sorted(p.name for p in tmp_path.glob("shard-*"))
    assert len(shards) > 1
    dataset_files = {p: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p.is_file()}
    first = [s.id for s in ShardReader(tmp_path)]
    assert sorted(hashed) == shards
    assert sorted(json.loads(store.verified_record(tmp_path).read_text())) == shards
    assert {p: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p.is_file()} == dataset_files  # not written
    assert [s.id for s in ShardReader(tmp_path)] == first and sorted(hashed) == shards  # no second hash
    list(ShardReader(tmp_path, verify="full"))
    assert len(hashed) == 2 * len(shards)
    os.utime(tmp_path / shards[0])  # same bytes, new identity: checked again (and passes)
    list(ShardReader(tmp_path))
    assert hashed[2 * len(shards):] == [shards[0]]


def test_shard_changed_after_verification_is_refused(tmp_path, monkeypatch):
    """A byte flipped in place after a passing check, with size and mtime put back, is still refused."""
    _aged_split(tmp_path, monkeypatch)
    list(ShardReader(tmp_path))
    shard = tmp_path / "shard-00001.safetensors"
    st = shard.stat()
    with open(shard, "r+b") as fh:
        fh.seek(st.st_size // 2)
        byte = fh.read(1)
        fh.seek(st.st_size // 2)
        fh.write(bytes([byte[0] ^ 0xFF]))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert shard.stat().st_size == st.st_size and shard.stat().st_mtime_ns == st.st_mtime_ns
    first_of_shard_1 = json.loads((tmp_path / "manifest.json").read_text())["shards"][0]["samples"]
    with pytest.raises(CorruptShardError, match="shard-00001.safetensors is corrupt"):
        ShardReader(tmp_path)[first_of_shard_1]


def test_replaced_shard_is_checked_again(tmp_path, monkeypatch):
    """Another file under the verified name (a copy with the same size and mtime) is hashed and refused."""
    _aged_split(tmp_path, monkeypatch)
    list(ShardReader(tmp_path))
    shard = tmp_path / "shard-00000.safetensors"
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    other = tmp_path / "other.bin"
    other.write_bytes(bytes(data))
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, shard)
    with pytest.raises(CorruptShardError, match="shard-00000.safetensors is corrupt"):
        ShardReader(tmp_path)[0]


# ----------------------------------------------------------------------------- soundness and repair


def flip_bytes(path, count=16):
    """Flip ``count`` bytes in the middle of a file, as bit rot or a bad copy would."""
    data = bytearray(path.read_bytes())
    for k in range(count):
        data[len(data) // 2 + k] ^= 0xFF
    path.write_bytes(bytes(data))


def test_verify_split_reports_each_shard_and_hashes_only_what_changed(tmp_path, monkeypatch):
    hashed = _aged_split(tmp_path, monkeypatch)
    checks = store.verify_split(tmp_path)
    assert [c.file for c in checks] == sorted(p.name for p in tmp_path.glob("shard-*")) and len(checks) > 2
    assert all(c.ok and c.hashed for c in checks) and len(hashed) == len(checks)
    flip_bytes(tmp_path / "shard-00001.safetensors")
    (tmp_path / "shard-00002.safetensors").unlink()
    again = {c.file: c for c in store.verify_split(tmp_path)}
    assert hashed[len(checks):] == ["shard-00001.safetensors"]  # the unchanged ones are trusted from the record
    assert again["shard-00001.safetensors"].problem == "its sha256 does not match the manifest's"
    assert again["shard-00002.safetensors"].problem == "missing"
    assert again["shard-00000.safetensors"].ok and not again["shard-00000.safetensors"].hashed
    (tmp_path / "manifest.json").write_text("{not json")
    [only] = store.verify_split(tmp_path)
    assert only.file == "manifest.json" and "cannot be read" in only.problem


def test_dropped_shards_are_stored_again_under_new_names(tmp_path):
    """--repair's step: a corrupt shard leaves the manifest; the writer's next run stores exactly
    its samples again, in a shard of a number never used before."""
    write(tmp_path, range(20))
    names = sorted(p.name for p in tmp_path.glob("shard-*"))
    flip_bytes(tmp_path / names[1])
    lost = store.drop_shards(tmp_path, [names[1]])
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert not manifest["complete"] and manifest["num_samples"] == 20 - lost and lost > 0
    assert not (tmp_path / names[1]).exists()
    with ShardWriter(tmp_path, LAYERS, 64, "bfloat16", 1000, {"config_hash": "h1"}) as w:
        missing = [i for i in range(20) if make_sample(i)[0] not in w.done_ids()]
        assert len(missing) == lost
        for i in missing:
            w.add(*make_sample(i))
    assert f"shard-{len(names):05d}.safetensors" in {s["file"] for s in w.manifest["shards"]}
    assert sorted(ShardReader(tmp_path, verify="full").sample_ids()) == sorted(make_sample(i)[0] for i in range(20))


def test_a_writer_writes_a_shard_once_its_buffer_is_old(tmp_path):
    with ShardWriter(tmp_path, LAYERS, 64, "bfloat16", 10**9, {"config_hash": "h1"}, max_buffer_s=0.0) as w:
        w.add(*make_sample(0))
        assert len(w.manifest["shards"]) == 1 and w.num_buffered == 0
        w.add(*make_sample(1))
        assert len(w.manifest["shards"]) == 2


def test_a_full_disk_while_closing_keeps_the_error_that_ended_the_block(small_disk):
    disk = small_disk(256 << 10)
    with pytest.raises(ValueError, match="the real error"):
        with ShardWriter(disk.path / "train", LAYERS, 256, "float32", 10**9, {"config_hash": "h1"}) as w:
            for i in range(8):  # ~1 MiB buffered: more than the disk holds
                w.add(*make_sample(i, 256))
            raise ValueError("the real error")
    assert not [p for p in (disk.path / "train").iterdir() if p.name.startswith((".shard", "shard"))]


def test_free_space_check_names_the_disk_and_what_needs_it(small_disk):
    disk = small_disk(1 << 20)
    where = re.escape(f"at {disk.path} (on {disk.path}): the test needs 2.0 MiB but only")
    with pytest.raises(DiskSpaceError, match=where):
        check_free_space(disk.path / "x", 2 << 20, what="the test")
    assert store.mount_point(disk.path / "x" / "y") == disk.path
