"""Against a real ``mlflow server`` (HTTP, proxied artifacts): no local-store assumptions."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from peagle.config import TrackingConfig
from peagle.tracking.mlflow_run import Tracker
from peagle.tracking.registry import download_champion, promote_if_better, register_head


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_uri(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
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
        proc.wait(timeout=30)
        log.close()


@pytest.mark.slow
def test_tracking_and_registry_through_a_tracking_server(server_uri, tmp_path, make_head_dir, monkeypatch):
    monkeypatch.setenv("PEAGLE_HOME", str(tmp_path / "home"))  # nothing may land in a local store
    head = make_head_dir(tmp_path / "head", seed=1)
    with Tracker(TrackingConfig(tracking_uri=server_uri), "org/model") as tracker:
        with tracker.stage("train") as train:
            train.log_metrics({"loss": 1.0}, step=1)
        version = register_head(tracker, tracker.run_id, head, tracker.registered_model_name, {"k": 3}, {"acc": 0.5})
        decision = promote_if_better(tracker, tracker.registered_model_name, version.version, 0.5, 0.0, True)
        served = download_champion(tracker, tracker.registered_model_name, tmp_path / "served")

    assert version.source.startswith("mlflow-artifacts:/")
    assert decision.promoted
    assert (served / "model.safetensors").read_bytes() == (head / "model.safetensors").read_bytes()
    assert tracker.run_url().startswith(f"{server_uri}/#/experiments/")
    assert not (tmp_path / "home" / "mlflow").exists()
