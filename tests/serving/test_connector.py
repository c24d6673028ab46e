"""The hidden-states connector's config, discovery by vLLM, atomic writes and reads."""

import os
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from peagle.serving.connector import (
    CONNECTOR_NAME,
    HiddenStatesReadError,
    PeagleHiddenStatesConnector,
    _CopyDone,
    _open_exclusive_lock,
    hidden_states_kv_transfer_config,
    read_hidden_states_file,
)


def test_kv_transfer_config_points_vllm_at_our_module(tmp_path):
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cfg = hidden_states_kv_transfer_config(tmp_path / "hs")
    assert cfg["kv_connector_extra_config"]["shared_storage_path"] == str((tmp_path / "hs").resolve())
    cls = KVConnectorFactory.get_connector_class(KVTransferConfig(**cfg))  # vLLM's own lookup
    assert cls is PeagleHiddenStatesConnector and cls.__name__ == CONNECTOR_NAME


def test_write_is_atomic_and_releases_the_lock(tmp_path):
    path = str(tmp_path / "req.safetensors")
    tensors = {"hidden_states": torch.randn(5, 3, 8), "token_ids": torch.arange(5)}
    lock_fd = _open_exclusive_lock(path)
    writer = threading.Thread(
        target=lambda: (time.sleep(0.3), PeagleHiddenStatesConnector._write_tensors(tensors, _CopyDone(), path, lock_fd))
    )
    writer.start()
    started = time.monotonic()
    data = read_hidden_states_file(path)  # blocks on the writer's lock, not on polling
    writer.join()
    assert time.monotonic() - started >= 0.25
    assert torch.equal(data["hidden_states"], tensors["hidden_states"])
    assert torch.equal(data["token_ids"], tensors["token_ids"])
    assert os.listdir(tmp_path) == []  # file, lock and no .tmp left behind


def test_read_keeps_file_when_asked(tmp_path):
    path = tmp_path / "r.safetensors"
    save_file({"hidden_states": torch.zeros(2, 1, 4), "token_ids": torch.arange(2)}, str(path))
    read_hidden_states_file(path, delete=False)
    assert path.exists()


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(HiddenStatesReadError, match="never appeared"):
        read_hidden_states_file(tmp_path / "absent.safetensors", timeout_s=0.1)



def test_a_failed_write_is_reported_at_once_with_its_cause(small_disk):
    """vLLM's writer thread runs out of disk: the reader (asleep on the file's lock) fails at once
    with ENOSPC and the folder, instead of waiting for a file that never comes."""
    import errno

    from peagle.serving.connector import HiddenStatesWriteError

    disk = small_disk(64 << 10)
    path = str(disk.path / "req.safetensors")
    tensors = {"hidden_states": torch.randn(128, 4, 256), "token_ids": torch.arange(128)}  # 512 KiB
    lock_fd = _open_exclusive_lock(path)
    failed = []

    def write():
        time.sleep(0.3)
        try:
            PeagleHiddenStatesConnector._write_tensors(tensors, _CopyDone(), path, lock_fd)
        except Exception as err:  # noqa: BLE001 - vLLM logs it; the test only keeps it
            failed.append(err)

    writer = threading.Thread(target=write)
    writer.start()
    started = time.monotonic()
    with pytest.raises(HiddenStatesWriteError, match=f"failed on {disk.path}: No space left on device") as info:
        read_hidden_states_file(path, timeout_s=10)
    writer.join()
    assert info.value.errno == errno.ENOSPC and failed
    assert time.monotonic() - started < 5  # the lock's release, not the 600 s wait for the file
    assert os.listdir(disk.path) == []  # no lock, marker or half-written file left
