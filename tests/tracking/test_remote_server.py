"""Against a real ``mlflow server`` (HTTP, proxied artifacts): no local-store assumptions."""

from __future__ import annotations

import pytest

from peagle.config import TrackingConfig
from peagle.publish.gate import promote_if_better
from peagle.publish.pull import download_champion
from peagle.publish.registry import register_head
from peagle.tracking.mlflow_run import Tracker


@pytest.mark.slow
def test_tracking_and_registry_through_a_tracking_server(mlflow_server, tmp_path, make_head_dir, monkeypatch):
    monkeypatch.setenv("PEAGLE_HOME", str(tmp_path / "home"))  # nothing may land in a local store
    head = make_head_dir(tmp_path / "head", seed=1)
    with Tracker(TrackingConfig(tracking_uri=mlflow_server), "org/model") as tracker:
        with tracker.stage("train") as train:
            train.log_metrics({"loss": 1.0}, step=1)
        version = register_head(tracker, tracker.run_id, head, tracker.registered_model_name, {"k": 3}, {"acc": 0.5})
        decision = promote_if_better(tracker, tracker.registered_model_name, version.version, 0.5, 0.0, True)
        served = download_champion(tracker, tracker.registered_model_name, tmp_path / "served")

    assert version.source.startswith("mlflow-artifacts:/")
    assert decision.promoted
    assert (served / "model.safetensors").read_bytes() == (head / "model.safetensors").read_bytes()
    assert tracker.run_url().startswith(f"{mlflow_server}/#/experiments/")
    assert not (tmp_path / "home" / "mlflow").exists()
