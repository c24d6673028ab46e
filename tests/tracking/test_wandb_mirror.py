"""With wandb enabled (offline), the tracker mirrors params and metrics into a local wandb run."""

from __future__ import annotations

import time

import pytest

from peagle.config import TrackingConfig, WandbConfig, load_config
from peagle.tracking.mlflow_run import TAG_WANDB_RUN, Tracker
from peagle.tracking.wandb_mirror import check_wandb_credentials

FAKE_HF_TOKEN = "hf_FakeTokenForPeagleWandbTests98765"


@pytest.fixture()
def wandb_home(tmp_path, monkeypatch):
    """wandb's folders under a throwaway project home."""
    monkeypatch.setenv("PEAGLE_HOME", str(tmp_path / "home"))
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HF_TOKEN", FAKE_HF_TOKEN)
    return tmp_path / "home" / "wandb"


def read_transaction_log(run_dir, expect: bytes = b"acceptance_k3", timeout_s: float = 30.0) -> bytes:
    """The run's ``.wandb`` log; wandb's service writes it asynchronously after ``finish()``."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = b"".join(p.read_bytes() for p in run_dir.glob("*.wandb"))
        if expect in records or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def test_offline_mirror_writes_a_run_dir(mlflow_uri, wandb_home):
    cfg = load_config("configs/tiny.yaml", {
        "tracking.tracking_uri": mlflow_uri,
        "tracking.wandb": {"enabled": True, "mode": "offline", "project": "peagle-tests"},
        "target.revision": FAKE_HF_TOKEN,
    })
    with Tracker(cfg.tracking, "embedded", cfg) as tracker:
        with tracker.stage("train") as train:
            train.log_metrics({"loss": 2.0}, step=1)
            train.log_metrics({"loss": 1.0}, step=2)
            train.log_step_records([{"step": 3, "time": time.time(), "loss": 0.5, "tokens_per_s": 900.0}])
        tracker.log_metrics_per_k({1: 0.8, 3: 0.6}, "acceptance")
        run_dir = tracker._mirror.run_dir

    assert run_dir.parent.parent == wandb_home and run_dir.name.startswith("offline-run-")
    records = read_transaction_log(run_dir)
    for key in (b"train/loss", b"train/step", b"train/tokens_per_s", b"acceptance_k3", b"train.peagle.k_train",
                b"mlflow_run_id"):
        assert key in records, key
    written = b"".join(p.read_bytes() for p in run_dir.rglob("*") if p.is_file())
    assert FAKE_HF_TOKEN.encode() not in written
    tags = tracker.client.get_run(tracker.run_id).data.tags
    assert tags[TAG_WANDB_RUN].endswith(tracker._mirror.run.id)


def test_online_mode_needs_the_key_in_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="WANDB_API_KEY"):
        check_wandb_credentials(WandbConfig(enabled=True, mode="online"))
    # and a tracker fails before it creates any MLflow run
    with pytest.raises(RuntimeError, match="WANDB_API_KEY"):
        Tracker(TrackingConfig(tracking_uri=f"sqlite:///{tmp_path}/unused.db",
                               wandb=WandbConfig(enabled=True, mode="online")), "embedded")
    assert not (tmp_path / "unused.db").exists()
