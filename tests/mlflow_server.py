"""A real ``mlflow server`` for tests: SQLite backend, proxied artifacts, a free 127.0.0.1 port.

    with mlflow_server(tmp_path) as uri:      # "http://127.0.0.1:PORT"
        MlflowClient(tracking_uri=uri)...     # the REST client, as users reach a server

Started as users start it (``python -m mlflow server``); stopped (its process group killed) on exit.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from tests.processes import free_port, process_group, wait_http_ok


@contextlib.contextmanager
def mlflow_server(root: Path, timeout_s: float = 180):
    """The URI of a real ``mlflow server`` whose store and artifacts live under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", f"sqlite:///{root / 'server.db'}", "--artifacts-destination", str(root / "artifacts")]
    log = root / "server.log"
    uri = f"http://127.0.0.1:{port}"
    # No job runner: it serves MLflow's GenAI jobs, which peagle never submits, with eight
    # processes of their own polling beside the server for as long as it runs.
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with process_group(cmd, log, env=env) as proc:
        wait_http_ok(f"{uri}/health", proc, log, timeout_s, what="mlflow server")
        yield uri
