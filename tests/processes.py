"""The servers and workers the tests start as users start them (``prefect server start``,
``prefect worker start``, ``mlflow server``, ``vllm serve``): each in a process group of its
own, its output in a log file, stopped with its children when the block ends, also on failure.

    with process_group([...], log, env=env) as proc:
        wait_http_ok(f"{url}/health", proc, log, timeout_s=180, what="mlflow server")
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(log: Path, chars: int = 3000) -> str:
    return Path(log).read_text(errors="replace")[-chars:] if Path(log).is_file() else "(no log)"


@contextlib.contextmanager
def process_group(cmd: list[str], log: Path, *, env: dict | None = None, cwd: Path | None = None,
                  stop_timeout_s: float = 60):
    """Start ``cmd`` in a new session writing to ``log``; yield the process. On exit SIGTERM its
    process group (a server and the workers it started), SIGKILL what lingers: a loaded machine
    can make the graceful stop lag."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
    try:
        yield proc
    finally:
        stop_group(proc, stop_timeout_s)


def stop_group(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=timeout_s)
            return
        except subprocess.TimeoutExpired:
            continue


def wait_http_ok(url: str, proc: subprocess.Popen, log: Path, timeout_s: float, what: str) -> None:
    """Poll ``url`` until it answers 200; raise with the log's tail if ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log_tail(log)}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        time.sleep(1)
    raise TimeoutError(f"{what} did not answer {url} within {timeout_s:.0f} s:\n{log_tail(log)}")
