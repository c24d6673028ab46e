"""Training metrics in MLflow as users watch them: every step while the ranks run, at the
step's own time; system metrics on the stage; the dataset as the run's input."""

from __future__ import annotations

import json
import logging
import sys
import textwrap
import time

import torch

from peagle.config import TrackingConfig
from peagle.data.store import ShardWriter
from peagle.layout import DataLayout
from peagle.tracking.datasets import BUILT, TRAINING_CONTEXTS, built_datasets, log_datasets
from peagle.tracking.mlflow_run import Tracker, stage_run
from peagle.train.launch import TrainingProgress, run_streaming

# A stand-in for rank 0 (records as MetricsLog writes them, wall-clock ``time`` included).
# After step 3 it waits until the parent says MLflow holds step 3: a follower that logged
# only after the ranks exit would leave it waiting, and it fails.
FAKE_RANK = textwrap.dedent("""
    import json, os, sys, time
    path, seen, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    for step in range(1, steps + 1):
        time.sleep(0.3)
        record = {"step": step, "epoch": 0, "lr": 1e-3 / step, "loss": 3.0 / step, "acc/depth_0": 0.1 * step,
                  "tokens": 100, "step_time_s": 0.3, "tokens_per_s": 333.0, "time": time.time()}
        with open(path, "a") as fh:
            fh.write(json.dumps(record) + "\\n")
        if step == 3:
            deadline = time.monotonic() + 60
            while not os.path.exists(seen):
                if time.monotonic() > deadline:
                    sys.exit("step 3 never reached MLflow while this rank ran")
                time.sleep(0.1)
    with open(path, "a") as fh:
        fh.write(json.dumps({"step": steps, "eval/acceptance": 2.5, "time": time.time()}) + "\\n")
""")


def test_steps_reach_the_stage_run_while_the_ranks_run(tracking, tmp_path):
    metrics, seen = tmp_path / "metrics.jsonl", tmp_path / "seen"
    with Tracker(tracking, "live-tests", run_name="live") as tracker:
        with tracker.stage("train") as stage:
            run = stage_run(tracking, stage.run_id)  # what the launcher gets: the open stage run
            assert run is stage

            def on_records(records):
                run.log_step_records(records)
                if any(m.step == 3 for m in tracker.client.get_metric_history(stage.run_id, "loss")):
                    seen.touch()

            progress = TrainingProgress(metrics, total_steps=6, label="train peagle", on_records=on_records)
            run_streaming([sys.executable, "-c", FAKE_RANK, str(metrics), str(seen), "6"],
                          output=tmp_path / "train.log", on_poll=progress.poll, poll_s=0.2)
            progress.poll(final=True)
            history = [json.loads(line) for line in metrics.read_text().splitlines()]
            run.log_step_records(history)  # what the pipeline sends afterwards: nothing new

    client = tracker.client
    records = [r for r in history if "loss" in r]
    loss = client.get_metric_history(stage.run_id, "loss")
    assert [(m.step, m.value) for m in loss] == [(r["step"], r["loss"]) for r in records]  # each step once
    assert [m.timestamp for m in loss] == [int(r["time"] * 1000) for r in records]  # rank 0's clock
    assert len({m.timestamp for m in loss}) == len(loss)
    for key in ("lr", "acc/depth_0", "tokens_per_s", "step_time_s"):
        assert [m.step for m in client.get_metric_history(stage.run_id, key)] == list(range(1, 7)), key
    assert [(m.step, m.value) for m in client.get_metric_history(stage.run_id, "eval/acceptance")] == [(6, 2.5)]
    assert "time" not in client.get_run(stage.run_id).data.metrics


def test_a_tracking_failure_never_stops_training(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="peagle.train.launch")
    metrics = tmp_path / "metrics.jsonl"
    rank = "import json, sys, time\nfor s in (1, 2):\n    time.sleep(0.3)\n" \
           "    open(sys.argv[1], 'a').write(json.dumps({'step': s, 'loss': 1.0}) + '\\n')\n"

    def unreachable(records):
        raise ConnectionError("tracking server unreachable")

    progress = TrainingProgress(metrics, total_steps=2, label="train peagle", on_records=unreachable)
    run_streaming([sys.executable, "-c", rank, str(metrics)], on_poll=progress.poll, poll_s=0.1)
    progress.poll(final=True)
    assert "could not record steps" in caplog.text and "training goes on" in caplog.text
    assert len(metrics.read_text().splitlines()) == 2


def test_system_metrics_are_sampled_on_a_stage_run(mlflow_uri):
    tracking = TrackingConfig(tracking_uri=mlflow_uri, system_metrics_interval_s=0.5)
    with Tracker(tracking, "live-tests", run_name="system") as tracker:
        with tracker.stage("train", system_metrics=True) as stage:
            time.sleep(2.0)
        with tracker.stage("export") as plain:
            pass
    metrics = tracker.client.get_run(stage.run_id).data.metrics
    for key in ("system/cpu_utilization_percentage", "system/system_memory_usage_megabytes",
                "system/disk_usage_percentage"):
        assert key in metrics, sorted(metrics)
    assert len(tracker.client.get_metric_history(stage.run_id, "system/cpu_utilization_percentage")) >= 2
    assert not [k for k in tracker.client.get_run(plain.run_id).data.metrics if k.startswith("system/")]


def test_the_built_dataset_is_the_input_of_its_runs(tracking, tmp_path):
    data = DataLayout(tmp_path / "data")
    for split, n in (("train", 5), ("eval", 2)):
        with ShardWriter(data.split(split), [2, 4], 8, "bfloat16", 100, {"config_hash": "c0ffee", "target": "t"}) as w:
            for i in range(n):
                w.add(f"{split}-{i}", torch.arange(6), torch.ones(6, dtype=torch.bool), torch.randn(6, 2, 8))
    prompts = {"data/prompts/code_train.jsonl": "ab" * 32, "https://bot:S3cretPassw0rd@hub.example/p.jsonl": "cd" * 32}
    with Tracker(tracking, "live-tests", run_name="datasets") as tracker:
        datasets = built_datasets(data.root, "demo", prompts)
        with tracker.stage("data") as built:
            log_datasets(built, datasets, BUILT)
        with tracker.stage("train") as train:
            log_datasets(train, datasets, TRAINING_CONTEXTS)

    def inputs(run_id):
        found = tracker.client.get_run(run_id).inputs.dataset_inputs
        return {i.dataset.name: (i.dataset, {t.key: t.value for t in i.tags}) for i in found}

    seen = inputs(train.run_id)
    assert {name: tags["mlflow.data.context"] for name, (_, tags) in seen.items()} == \
        {"demo-train": "training", "demo-eval": "evaluation"}
    assert {tags["mlflow.data.context"] for _, tags in inputs(built.run_id).values()} == {"output"}
    dataset, _ = seen["demo-train"]
    manifest = json.loads(data.manifest("train").read_text())
    profile = json.loads(dataset.profile)
    assert profile["manifest_sha256"].startswith(dataset.digest) and len(dataset.digest) == 16
    assert (profile["samples"], profile["tokens"], profile["storage_dtype"]) == \
        (5, manifest["num_tokens"], "bfloat16")
    assert profile["prompt_files"]["data/prompts/code_train.jsonl"] == "ab" * 32 and profile["layer_ids"] == [2, 4]
    assert "S3cretPassw0rd" not in dataset.profile  # scrubbed like every param and tag
    assert json.loads(dataset.source) == {"uri": str(data.split("train").resolve())}
    assert dataset.source_type == "local"
