"""The project's hidden-states KV connector: vLLM's example connector, CPU-safe and atomic.

vLLM's ``extract_hidden_states`` speculative method stores the target's hidden states
of the chosen layers in a cache-only KV layer; a KV connector copies them out of the
cache when a request finishes and writes one safetensors file per request:
``hidden_states`` [T, len(layer_ids), Ht] and ``token_ids`` [T] (prompt tokens only).

The stock ``ExampleHiddenStatesConnector`` copies through pinned memory and CUDA
events, which do not exist on CPU. This subclass keeps its scheduling, locking and
file layout and changes two things:
- on CPU the copy out of the KV cache is an ordinary synchronous clone;
- every file is written under a temporary name and renamed (``peagle.fileio.atomic_path``),
  so a reader never sees a half-written file (on both CPU and GPU).
Requests sent with ``kv_transfer_params={"skip_hidden_states": True}`` (ordinary
generation on an extraction engine) write nothing.

A write that fails (a full disk) leaves an empty marker ``<file>.error-<errno>`` before the
writer releases the file's lock, so the reader fails at once with the cause instead of
waiting for a file that will never come; an empty file needs no data block, so the marker
can be made on a full disk.

The engine imports this module by name (``kv_connector_module_path``) in its own
process, so it must stay importable on its own.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

from peagle.fileio import DISK_FULL, atomic_path, error_number
from peagle.serving.generation import SKIP_KEY

CONNECTOR_NAME = "PeagleHiddenStatesConnector"
ERROR_MARK = ".error-"  # <file>.error-<errno>: the writer could not write <file>


def hidden_states_kv_transfer_config(out_dir: str | Path, *, num_writer_threads: int = 4) -> dict:
    """The ``kv_transfer_config`` that makes vLLM write hidden states under ``out_dir``."""
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": __name__,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "shared_storage_path": str(Path(out_dir).resolve()),
            "num_writer_threads": num_writer_threads,
        },
    }


class _CopyDone:
    """Stands in for a CUDA event when the copy out of the KV cache already happened."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class PeagleHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` that also runs on CPU and writes atomically."""

    def build_connector_meta(self, scheduler_output):
        """As the stock connector, minus requests that asked not to be saved."""
        meta = super().build_connector_meta(scheduler_output)
        for new_req in scheduler_output.scheduled_new_reqs:
            extra = (new_req.sampling_params.extra_args if new_req.sampling_params else None) or {}
            if (extra.get("kv_transfer_params") or {}).get(SKIP_KEY):
                meta.new_req_filenames.pop(new_req.req_id, None)
                self._request_filenames.pop(new_req.req_id, None)  # request_finished: nothing to save
        return meta

    def _submit_async_write(self, pending: PendingSave) -> None:
        assert self._kv_cache is not None
        if self._kv_cache.is_cuda:
            super()._submit_async_write(pending)  # pinned DtoH copy, then our _write_tensors
            return
        if not self._is_tp_rank_zero:
            return
        slots = _slot_mapping(pending.block_ids, self._block_size)
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = _open_exclusive_lock(pending.filename)
        done = _CopyDone()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(lambda f, rid=pending.req_id: self._on_write_done(rid, f))

    @staticmethod
    def _write_tensors(tensors: dict[str, torch.Tensor], event, filename: str, lock_fd: int | None) -> None:
        """Thread worker: wait for the copy, write the file atomically, release the lock.

        Not fsynced: a crash loses only files the data stage re-extracts on its next run.
        A failure is marked (``mark_write_failed``) before the lock is released.
        """
        try:
            event.synchronize()
            with atomic_path(filename, durable=False) as tmp:
                save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
        except BaseException as err:
            mark_write_failed(filename, err)
            raise
        finally:
            if lock_fd is not None:
                os.close(lock_fd)


def _slot_mapping(block_ids: list[int], block_size: int) -> torch.Tensor:
    blocks = torch.tensor(block_ids, dtype=torch.long)
    offsets = torch.arange(block_size, dtype=torch.long)
    return (blocks[:, None] * block_size + offsets[None, :]).flatten()


def _open_exclusive_lock(filename: str) -> int:
    fd = os.open(filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


class HiddenStatesReadError(RuntimeError):
    """The engine reported a hidden-states file that never appeared (its write failed)."""


class HiddenStatesWriteError(OSError):
    """The engine's writer could not write a hidden-states file; ``errno`` says why (ENOSPC: a full disk)."""


def mark_write_failed(filename: str, err: BaseException) -> None:
    """Leave ``<filename>.error-<errno>`` for the reader (best effort: the reader still times out without it)."""
    try:
        with open(f"{filename}{ERROR_MARK}{error_number(err) or 0}", "w"):
            pass
    except OSError:
        pass


def write_failure(path: str) -> HiddenStatesWriteError | None:
    """The writer's failure to write ``path`` as an exception to raise, or None when it left no marker."""
    folder, name = os.path.split(path)
    try:
        marks = [m for m in os.listdir(folder or ".") if m.startswith(name + ERROR_MARK)]
    except FileNotFoundError:
        return None
    if not marks:
        return None
    code = int(marks[0][len(name + ERROR_MARK):] or 0)
    for m in marks:
        os.remove(os.path.join(folder, m))
    cause = os.strerror(code) if code else "an error (see the engine log)"
    where = f" on {folder}" if code in DISK_FULL else ""
    return HiddenStatesWriteError(code, f"vLLM's hidden-states writer failed{where}: {cause}", path)


def read_hidden_states_file(path: str | Path, *, delete: bool = True, timeout_s: float = 600.0) -> dict[str, torch.Tensor]:
    """Load one request's file once its writer is done, then (by default) delete it.

    Waits on the writer's lock (held from before the engine returned the path until
    the rename, or until a failed write was marked), then on the file itself for engines
    run without locks. A failed write raises ``HiddenStatesWriteError`` at once.
    """
    path = str(path)
    lock_path = path + ".lock"
    if os.path.exists(lock_path):
        with open(lock_path) as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)  # sleeps until the writer releases LOCK_EX
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if (failure := write_failure(path)) is not None:
            if os.path.exists(lock_path):
                os.remove(lock_path)
            raise failure
        if time.monotonic() > deadline:
            raise HiddenStatesReadError(
                f"{path}: vLLM reported hidden states here but the file never appeared "
                "(its writer thread failed; see the engine log)"
            )
        time.sleep(0.01)
    data = load_file(path, device="cpu")
    if delete:
        for p in (path, lock_path):
            if os.path.exists(p):
                os.remove(p)
    return data
