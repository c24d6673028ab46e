"""Atomic writes: a reader sees the old content or the new, never half; failures leave nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from peagle.fileio import (
    atomic_open,
    atomic_path,
    is_temp_name,
    publish_dir,
    staged_dir,
    temp_sibling,
    write_bytes_atomic,
    write_json_atomic,
    write_text_atomic,
)

REPO = Path(__file__).resolve().parent.parent


def test_writes_replace_the_file_and_leave_nothing_beside_it(tmp_path):
    path = tmp_path / "build.json"
    write_json_atomic(path, {"a": 1})
    write_json_atomic(path, {"a": 2, "b": [1, 2]}, indent=1)
    assert json.loads(path.read_text()) == {"a": 2, "b": [1, 2]}
    assert path.read_text() == json.dumps({"a": 2, "b": [1, 2]}, indent=1)
    write_text_atomic(tmp_path / "note.txt", "héllo\n")
    write_bytes_atomic(tmp_path / "blob.bin", b"\x00\x01")
    assert (tmp_path / "note.txt").read_text(encoding="utf-8") == "héllo\n"
    assert (tmp_path / "blob.bin").read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blob.bin", "build.json", "note.txt"]


def test_a_failed_write_keeps_the_old_content(tmp_path):
    path = tmp_path / "manifest.json"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="disk on fire"):
        with atomic_open(path, "w") as fh:
            fh.write("half of the new")
            raise RuntimeError("disk on fire")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_a_library_that_wrote_nothing_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing was written"):
        with atomic_path(tmp_path / "plot.png") as tmp:
            assert tmp.suffix == ".png" and tmp.parent == tmp_path and is_temp_name(tmp.name)
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="not a write mode"):
        with atomic_open(tmp_path / "x", "a"):
            pass


KILLED_WRITER = """
import sys, time
from peagle.fileio import atomic_open
with atomic_open(sys.argv[1], "wb") as fh:
    fh.write(b"new" * 1000)
    fh.flush()
    print("written", flush=True)
    time.sleep(60)
"""


def test_a_killed_writer_leaves_the_old_file_and_a_recognisable_temp(tmp_path):
    path = tmp_path / "shard-00000.safetensors"
    path.write_bytes(b"old shard")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(path)], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.readline().strip() == b"written"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert path.read_bytes() == b"old shard"
    leftovers = [p for p in tmp_path.iterdir() if p != path]
    assert len(leftovers) == 1 and is_temp_name(leftovers[0].name)
    assert leftovers[0].read_bytes() == b"new" * 1000


def test_publish_dir_swaps_whole_directories(tmp_path):
    dst = tmp_path / "target"
    dst.mkdir()
    (dst / "stale.txt").write_text("old")
    new = temp_sibling(dst)
    new.mkdir()
    (new / "build_report.json").write_text("{}")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        publish_dir(new, dst, overwrite=False)
    assert [p.name for p in dst.iterdir()] == ["stale.txt"]
    publish_dir(new, dst)
    assert [p.name for p in dst.iterdir()] == ["build_report.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["target"]


def test_staged_dir_publishes_on_success_and_removes_the_stage_on_failure(tmp_path):
    dst = tmp_path / "heads" / "peagle"
    with staged_dir(dst) as stage:
        assert not dst.exists() and stage.parent == dst.parent
        (stage / "config.json").write_text("{}")
    assert [p.name for p in dst.iterdir()] == ["config.json"]
    with pytest.raises(RuntimeError):
        with staged_dir(dst) as stage:
            (stage / "model.safetensors").write_bytes(b"half")
            raise RuntimeError("validation failed")
    assert [p.name for p in dst.iterdir()] == ["config.json"]
    assert [p.name for p in dst.parent.iterdir()] == ["peagle"]


def test_temp_names_are_unique_and_recognised():
    a, b = temp_sibling("/x/manifest.json"), temp_sibling("/x/manifest.json")
    assert a != b and a.parent == Path("/x") and a.suffix == ".json"
    assert is_temp_name(a.name) and is_temp_name("manifest.json.tmp")
    assert is_temp_name(temp_sibling("/x/step-000002", "old").name)  # what publish_dir moves aside
    assert not is_temp_name("manifest.json") and not is_temp_name("shard-00001.safetensors")
