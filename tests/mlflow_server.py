"""A real ``mlflow server`` for tests: SQLite backend, proxied artifacts, a free 127.0.0.1 port.

    with mlflow_server(tmp_path) as uri:      # "http://127.0.0.1:PORT"
        MlflowClient(tracking_uri=uri)...     # the REST client, as users reach a server

Started as users start it (``python -m mlflow server``); stopped (its process group killed) on exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(root: Path, timeout_s: float = 180):
    """The URI of a real ``mlflow server`` whose store and artifacts live under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", f"sqlite:///{root / 'server.db'}", "--artifacts-destination", str(root / "artifacts")]
    log = open(root / "server.log", "wb")  # noqa: SIM115 - closed below, after the server
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"})
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"mlflow server did not start: {(root / 'server.log').read_text()[-2000:]}")
                time.sleep(1)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and the workers it started
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # a loaded machine: the graceful stop can lag
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()
