"""One SQLite MLflow store for the whole tracking test session (creating one costs ~2 s), and a
real ``mlflow server`` over HTTP for the tests about tracking servers and registry consumers."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
from safetensors.numpy import save_file

from peagle.config import TrackingConfig, load_config


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture(scope="session")
def tracking(mlflow_uri) -> TrackingConfig:
    return TrackingConfig(tracking_uri=mlflow_uri)


@pytest.fixture()
def pipeline_cfg(mlflow_uri):
    return load_config("configs/demo.yaml", {"tracking.tracking_uri": mlflow_uri})


@pytest.fixture(scope="session")
def make_head_dir():
    return _make_head_dir


def _make_head_dir(path, seed: int = 0, hidden: int = 8):
    """A small head directory in vLLM's layout (the registry only moves bytes around)."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "seed": seed}))
    save_file(
        {"fc.weight": rng.standard_normal((hidden, 3 * hidden)).astype(np.float32),
         "norm.weight": np.ones(hidden, dtype=np.float32)},
        str(path / "model.safetensors"),
    )
    (path / "README.md").write_text(f"# head {seed}\n")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    return _free_port()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """The URI of a real ``mlflow server`` (SQLite backend, proxied artifacts), stopped afterwards."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", f"sqlite:///{root / 'server.db'}", "--artifacts-destination", str(root / "artifacts")]
    log = open(root / "server.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"})
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"mlflow server did not start: {(root / 'server.log').read_text()[-2000:]}")
                time.sleep(1)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and the workers it started
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # a loaded machine: gunicorn's graceful stop can lag
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()
