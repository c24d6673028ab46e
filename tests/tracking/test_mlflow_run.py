"""The tracker writes params, metrics, artifacts and nested stage runs to a real MLflow store."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from peagle.config import TrackingConfig, load_config
from peagle.paths import REPO_ROOT
from peagle.tracking.mlflow_run import (
    MAX_PARAM_VAL_LENGTH,
    Tracker,
    flatten_params,
    manifest_tag,
    resolve_tracking_uri,
    sanitize_target_id,
)
from peagle.tracking.scrub import MASK, scrub, scrub_text

FAKE_HF_TOKEN = "hf_FakeTokenForPeagleTests0123456789"
DB_PASSWORD = "S3cretDbPassw0rd"


def stage_runs(client, tracker):
    runs = client.search_runs([tracker.experiment_id], f"tags.mlflow.parentRunId = '{tracker.run_id}'")
    return {r.info.run_name: r for r in runs}


def test_run_records_config_metrics_artifacts_and_stages(tracking, pipeline_cfg, tmp_path):
    report = tmp_path / "report.json"
    report.write_text('{"ok": true}')
    plots = tmp_path / "plots"
    plots.mkdir()
    (plots / "acceptance.csv").write_text("k,acc\n1,0.9\n")
    manifest = tmp_path / "splits" / "train" / "manifest.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text('{"format_version": 1, "shards": []}')

    with Tracker(tracking, "meta-llama/Llama-3.1-8B-Instruct", pipeline_cfg) as tracker:
        with tracker.stage("train") as train:
            train.log_metrics({"loss": 2.0, "lr": 1e-3}, step=1)
            train.log_metrics({"loss": 1.5}, step=2)
        with tracker.stage("eval") as ev:
            ev.log_metrics_per_k({1: 0.9, 3: 0.7, 5: 0.55}, "acceptance")
        tracker.log_artifact(report)
        tracker.log_artifacts(plots, "plots")
        digest = tracker.set_data_manifest(manifest)
        assert "mlflow ui --backend-store-uri" in tracker.run_url() and tracker.run_id in tracker.run_url()

    client = tracker.client
    run = client.get_run(tracker.run_id)
    params, tags = run.data.params, run.data.tags
    assert run.info.status == "FINISHED"
    assert client.get_experiment(tracker.experiment_id).name == "peagle/meta-llama--Llama-3.1-8B-Instruct"
    # the full resolved config, defaults included, as dot keys
    assert params["train.peagle.k_train"] == str(pipeline_cfg.train.peagle.k_train)
    assert params["eval.ks"] == str(pipeline_cfg.eval.ks)
    assert params["data.sources.0.kind"] == "jsonl"
    assert params["data.sources.0.schema"] == "messages"
    assert params["drafter.hidden_size"] == "None"
    assert params["target.embedded.hidden_size"] == str(pipeline_cfg.target.embedded.hidden_size)
    # lineage and provenance tags
    assert tags["peagle.target"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert tags[manifest_tag("train")] == digest == hashlib.sha256(manifest.read_bytes()).hexdigest()
    head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert tags["peagle.git.commit"] == head.stdout.strip()
        assert tags["peagle.git.dirty"] in ("true", "false")
    # nested stage runs with their own metrics and durations on the parent
    stages = stage_runs(client, tracker)
    assert set(stages) == {"train", "eval"}
    assert all(r.info.status == "FINISHED" for r in stages.values())
    history = client.get_metric_history(stages["train"].info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(1, 2.0), (2, 1.5)]
    per_k = client.get_metric_history(stages["eval"].info.run_id, "acceptance")
    assert sorted((m.step, m.value) for m in per_k) == [(1, 0.9), (3, 0.7), (5, 0.55)]
    assert stages["eval"].data.metrics["acceptance_k3"] == 0.7
    assert run.data.metrics["train.duration_s"] >= 0
    # artifacts in the store's own artifact folder, not the working directory
    listed = {a.path for a in client.list_artifacts(tracker.run_id)}
    assert {"config", "plots", "report.json", "lineage"} <= listed
    local = Path(client.download_artifacts(tracker.run_id, "config/pipeline.yaml", str(tmp_path / "dl")))
    assert load_config(local) == pipeline_cfg
    db_dir = Path(tracking.tracking_uri.removeprefix("sqlite:///")).parent
    assert run.info.artifact_uri.startswith((db_dir / "artifacts").as_uri())


def test_secrets_never_reach_the_store(tracking, mlflow_uri, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", FAKE_HF_TOKEN)
    cfg = load_config("configs/tiny.yaml", {
        "tracking.tracking_uri": mlflow_uri,
        "target.revision": FAKE_HF_TOKEN,  # pasted into the wrong field
        "data.sources": [{"kind": "jsonl", "path": f"s3://peagle:{DB_PASSWORD}@bucket/prompts.jsonl"}],
        "tracking.benchmark_weights": {"code": 1.0},
    })
    with pytest.raises(RuntimeError), Tracker(tracking, "embedded", cfg) as tracker:
        tracker.set_tags({"source_url": f"https://host/data?token={DB_PASSWORD}&page=2"})
        with tracker.stage("data"):
            raise RuntimeError(f"could not download with {FAKE_HF_TOKEN} from postgresql://u:{DB_PASSWORD}@db/x")

    client = tracker.client
    runs = [client.get_run(tracker.run_id), *stage_runs(client, tracker).values()]
    dl = Path(client.download_artifacts(tracker.run_id, "", str(tmp_path / "dl")))
    texts = [str(r.data.params) + str(r.data.tags) for r in runs]
    texts += [p.read_text() for p in dl.rglob("*") if p.is_file()]
    for text in texts:
        assert FAKE_HF_TOKEN not in text and DB_PASSWORD not in text
    params = runs[0].data.params
    assert params["data.sources.0.path"] == f"s3://peagle:{MASK}@bucket/prompts.jsonl"
    assert params["target.mask_token"] == "<|mask|>"  # "token" in a key name is not a secret by itself
    # a failing stage fails both runs and says why (scrubbed)
    assert {r.info.status for r in runs} == {"FAILED"}
    assert "RuntimeError: could not download with ***" in runs[1].data.tags["peagle.error"]


def test_scrub_masks_secret_keys_and_values_only():
    cleaned = scrub({
        "wandb": {"api_key": "abc", "project": "peagle"},
        "hub": {"token": "whatever", "mask_token": "<|mask|>", "max_tokens": 256},
        "password": "pw", "url": "https://user:pw12@h/x", "note": "Bearer abcdefghijkl",
        "aws": "AKIAABCDEFGHIJKLMNOP", "gh": "ghp_" + "a" * 36,
    })
    assert cleaned["wandb"] == {"api_key": MASK, "project": "peagle"}
    assert cleaned["hub"] == {"token": MASK, "mask_token": "<|mask|>", "max_tokens": 256}
    assert cleaned["password"] == MASK and cleaned["url"] == f"https://user:{MASK}@h/x"
    assert MASK in cleaned["note"] and cleaned["aws"] == MASK and cleaned["gh"] == MASK
    assert scrub_text("sqlite:////tmp/mlflow.db") == "sqlite:////tmp/mlflow.db"


def test_flatten_params_truncates_to_mlflow_limit():
    flat = flatten_params({"a": {"b": "x" * (MAX_PARAM_VAL_LENGTH + 100), "c": [{"d": 1}, {"d": 2}]}, "e": {}})
    assert len(flat["a.b"]) == MAX_PARAM_VAL_LENGTH and flat["a.b"].endswith("[truncated]")
    assert flat["a.c.0.d"] == "1" and flat["a.c.1.d"] == "2" and flat["e"] == "{}"


def test_tracking_uri_from_environment_and_resume(mlflow_uri, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    with Tracker(TrackingConfig(experiment="peagle-tests/resume"), "embedded", run_name="resume") as first:
        first.log_metrics({"a": 1.0})
    assert first.tracking_uri == mlflow_uri
    with Tracker(TrackingConfig(experiment="peagle-tests/resume"), "embedded", run_id=first.run_id) as again:
        again.log_metrics({"b": 2.0})
    run = again.client.get_run(first.run_id)
    assert run.data.metrics == {"a": 1.0, "b": 2.0} and run.info.status == "FINISHED"


def test_default_store_lives_under_the_project_home(tmp_path, monkeypatch):
    monkeypatch.setenv("PEAGLE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = resolve_tracking_uri(TrackingConfig())
    assert uri == f"sqlite:///{tmp_path / 'home' / 'mlflow' / 'mlflow.db'}"
    note = tmp_path / "note.txt"
    note.write_text("hello")
    with Tracker(TrackingConfig(), "embedded") as tracker:
        tracker.log_artifact(note)
    stored = tmp_path / "home" / "mlflow" / "artifacts" / tracker.run_id / "artifacts" / "note.txt"
    assert stored.read_text() == "hello"


def test_target_ids_become_valid_names():
    assert sanitize_target_id("openai/gpt-oss-20b") == "openai--gpt-oss-20b"
    assert sanitize_target_id("/models/My Model:v2/") == "models--My_Model--v2"
    with pytest.raises(ValueError):
        sanitize_target_id("///")
