"""The shared pipeline run as an MLflow user sees it on a real ``mlflow server``, through the
REST client: stage runs, step-wise training metrics at the steps' own times, system metrics,
the dataset as an input, and the registered head with its card and the champion alias."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from peagle.layout import METRICS_FILE, RunLayout

pytestmark = pytest.mark.slow

MODEL = "peagle-embedded"


@pytest.fixture(scope="module")
def seen(pipeline_run):
    """(REST client, {stage name: run}) of the shared run's parent run."""
    from mlflow import MlflowClient

    uri = pipeline_run.overrides["tracking.tracking_uri"]
    assert uri.startswith("http://127.0.0.1:")  # a server over HTTP, not a local store
    client = MlflowClient(tracking_uri=uri)
    parent = client.get_run(pipeline_run.result.mlflow_run_id)
    runs = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    return client, {r.info.run_name: r for r in runs}


def rank0_records(pipeline_run, method: str) -> list[dict]:
    """What rank 0 wrote to ``metrics.jsonl`` while training ``method``'s head (the shared run
    trained one head per method: one identity directory each)."""
    heads = [d for d in RunLayout(pipeline_run.tmp / "run").method_checkpoints(method).iterdir()
             if (d / METRICS_FILE).exists()]
    assert len(heads) == 1, heads
    return [json.loads(line) for line in (heads[0] / METRICS_FILE).read_text().splitlines()]


@pytest.mark.parametrize(("stage", "method"), [("train", "peagle"), ("train-eagle3", "eagle3")])
def test_every_training_step_is_in_its_stage_run_at_its_own_time(seen, pipeline_run, stage, method):
    client, runs = seen
    run = runs[stage]
    records = rank0_records(pipeline_run, method)
    steps = [r for r in records if "loss" in r]
    loss = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in loss] == [(r["step"], r["loss"]) for r in steps]
    assert [m.timestamp for m in loss] == [int(r["time"] * 1000) for r in steps]
    assert len({m.timestamp for m in loss}) == len(loss) > 1  # one time per step, not one for all
    assert run.info.start_time <= loss[0].timestamp < loss[-1].timestamp <= run.info.end_time
    for key in ("lr", "tokens_per_s", "step_time_s", "acc/depth_0"):
        assert len(client.get_metric_history(run.info.run_id, key)) == len(steps), key
    evals = [r for r in records if "eval/acceptance" in r]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/acceptance")] == \
        [r["step"] for r in evals]
    assert "system/cpu_utilization_percentage" in run.data.metrics
    assert "system/system_memory_usage_megabytes" in run.data.metrics
    assert not [k for k in runs["export"].data.metrics if k.startswith("system/")]


def test_the_dataset_is_an_input_of_the_data_and_training_runs(seen, pipeline_run):
    client, runs = seen
    data_dir = Path(pipeline_run.result.data_dir)

    def inputs(stage):
        return {i.dataset.name: (i.dataset, {t.key: t.value for t in i.tags}["mlflow.data.context"])
                for i in runs[stage].inputs.dataset_inputs}

    assert {name: context for name, (_, context) in inputs("train").items()} == \
        {"suite-train": "training", "suite-eval": "evaluation"}
    assert {context for _, context in inputs("train-eagle3").values()} == {"training", "evaluation"}
    assert {context for _, context in inputs("data").values()} == {"output"}
    # The manifests as the shared run built them (its lineage): a later retraining test grows
    # the same dataset, so the files on disk may be newer than what this run logged.
    built = ast.literal_eval(pipeline_run.result.lineage["data_manifests"])
    data_metrics = runs["data"].data.metrics
    for split in ("train", "eval"):
        dataset, _ = inputs("train")[f"suite-{split}"]
        sha256 = built[split]
        assert dataset.digest == sha256[:16]
        assert json.loads(dataset.source)["uri"] == str((data_dir / "splits" / split).resolve())
        profile = json.loads(dataset.profile)
        assert (profile["samples"], profile["storage_dtype"], profile["manifest_sha256"]) == \
            (data_metrics[f"num_{split}"], "bfloat16", sha256)
        assert profile["tokens"] > 0
        assert list(profile["prompt_files"]) == [str(pipeline_run.tmp / "prompts.jsonl")]


def test_the_registered_head_shows_its_card_and_the_champion_alias(seen, pipeline_run):
    client, _ = seen
    result = pipeline_run.result
    assert pipeline_run.champion_after == result.model_version  # read over HTTP right after the run
    version = client.get_model_version(MODEL, result.model_version)
    card = version.description
    acceptance = result.online.acceptance_by_k("p-eagle")[3]
    assert card.startswith("# peagle-suite") and f"| 3 | {acceptance:.2f} |" in card
    assert "| K | P-EAGLE | EAGLE-3 |" in card and "vllm serve" in card and "license:" not in card
    champion = client.get_model_version_by_alias(MODEL, "champion")  # whichever head holds it now
    assert champion.description.startswith("# peagle-")
