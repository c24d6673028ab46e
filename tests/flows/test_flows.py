"""The Prefect flows on the embedded default, for real, on the shared pipeline run.

The first run is ``tests/conftest.py::pipeline_run`` (shared with the end-to-end tests);
here: a second run with unchanged inputs (data, training and online evaluation come from
the cache), the head published alone into another registry (its lineage goes with it), and a
retraining run with nothing new (does nothing). A retraining on new prompts runs where users
run it, as a scheduled deployment run: tests/flows/test_deployment_run.py.
"""

import json
import time
from pathlib import Path

import pytest

from flows.common import artifact_key
from peagle.lineage import read_head_lineage, recorded_lineage

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def two_runs(pipeline_run):
    """The shared run, then the same pipeline again: the second finds every expensive input unchanged."""
    from flows.pipeline import pipeline_flow

    tmp = pipeline_run.tmp
    data_files = {p: p.stat().st_mtime_ns for p in (tmp / "run" / "data").rglob("*") if p.is_file()}
    start = time.perf_counter()
    second = pipeline_flow(pipeline_run.config, pipeline_run.overrides)
    second_s = time.perf_counter() - start
    print(f"\npipeline: first run {pipeline_run.seconds:.1f} s, second (cached) {second_s:.1f} s; "
          f"stages second {second.stage_seconds}")
    return pipeline_run.result, second, pipeline_run.seconds, second_s, data_files


def runs_of_config(config_name: str):
    """A filter for the flow runs of one config ("<stage> <config name> (<target>)"): the
    session's Prefect server holds every other test's runs too."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    return FlowRunFilter(name=FlowRunFilterName(like_=f" {config_name} ("))


def task_run_states(name: str, config_name: str) -> list[str]:
    """State names of every run of task ``name``, oldest first (read from the Prefect API)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        runs = [r for r in client.read_task_runs(flow_run_filter=runs_of_config(config_name))
                if r.name.rsplit("-", 1)[0] == name]  # run names: "<task>-<n>"
    return [r.state.name for r in sorted(runs, key=lambda r: r.expected_start_time)]


def flow_run_names_completed(config_name: str) -> set[str]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        flows = {f.id: f.name for f in client.read_flows()}
        return {flows[r.flow_id] for r in client.read_flow_runs(flow_run_filter=runs_of_config(config_name))
                if r.state and r.state.is_completed()}


def test_pipeline_composes_every_stage_flow(two_runs):
    first, _, _, _, _ = two_runs
    assert {"peagle-pipeline", "peagle-data", "peagle-train", "peagle-evaluate", "peagle-publish"} <= \
        flow_run_names_completed(first.config_name)
    assert (Path(first.head_dir) / "model.safetensors").exists()
    assert first.online.acceptance_by_k("p-eagle")[3] > 1.0
    assert first.model_version == "1" and first.promotion.promoted


def test_second_run_reuses_the_cached_dataset_and_is_faster(two_runs):
    first, second, first_s, second_s, data_files = two_runs
    assert task_run_states("generate-data", first.config_name)[:2] == ["Completed", "Cached"]
    assert task_run_states("train", first.config_name)[:4] == ["Completed"] * 2 + ["Cached"] * 2  # P-EAGLE, EAGLE-3
    assert task_run_states("evaluate-online", first.config_name)[:2] == ["Completed", "Cached"]
    after = {p: p.stat().st_mtime_ns for p in data_files}
    assert after == data_files  # not one dataset file rewritten
    assert second.data_dir == first.data_dir
    assert second.online.acceptance_by_k("p-eagle") == first.online.acceptance_by_k("p-eagle")
    assert second_s < first_s / 2


def test_an_unchanged_rerun_registers_no_new_version(two_runs):
    first, second, _, _, _ = two_runs
    assert second.model_version == first.model_version and not second.promotion.promoted


def test_lineage_is_recorded_on_the_registered_version(two_runs, pipeline_run):
    from mlflow import MlflowClient

    first, *_ = two_runs
    tmp = pipeline_run.tmp
    client = MlflowClient(tracking_uri=pipeline_run.overrides["tracking.tracking_uri"])
    tags = client.get_model_version("peagle-embedded", first.model_version).tags
    prompt_files = json.loads(tags["peagle.lineage.prompt_files"])
    assert list(prompt_files) == [str(tmp / "prompts.jsonl")]
    assert tags["peagle.lineage.data_config_hash"] == first.lineage["data_config_hash"]
    assert tags["peagle.lineage.target_revision"].startswith("local:")
    assert "train" in tags["peagle.lineage.data_manifests"]
    assert recorded_lineage(client.get_model_version("peagle-embedded", first.model_version)) == \
        read_head_lineage(first.head_dir)  # the head's own lineage.json, shipped with it


def test_a_head_published_alone_carries_its_lineage_and_is_not_retrained(two_runs, pipeline_run, tmp_path):
    """The standalone publish flow (publish-demo) registers the run's head into another registry;
    a scheduled retrain against that registry finds the head's inputs unchanged."""
    from mlflow import MlflowClient

    from flows.retrain import retrain_flow
    from flows.stages import publish_flow

    first, *_ = two_runs
    overrides = {**pipeline_run.overrides, "tracking.tracking_uri": f"sqlite:///{tmp_path / 'other.db'}"}
    published = publish_flow(pipeline_run.config, overrides=overrides)
    version = MlflowClient(tracking_uri=overrides["tracking.tracking_uri"]).get_model_version(
        "peagle-embedded", published.version)
    assert published.promotion.promoted and recorded_lineage(version) == read_head_lineage(first.head_dir)
    result = retrain_flow(pipeline_run.config, overrides)
    assert not result.retrained and result.message.startswith(f"nothing new: champion v{published.version}")


def test_retraining_with_nothing_new_does_nothing(two_runs, pipeline_run):
    from flows.retrain import retrain_flow

    tmp = pipeline_run.tmp
    start = time.perf_counter()
    result = retrain_flow(pipeline_run.config, pipeline_run.overrides)
    seconds = time.perf_counter() - start
    print(f"\nretrain with nothing new: {seconds:.1f} s")
    assert not result.retrained and result.pipeline is None
    assert "nothing new" in result.message
    assert seconds < 45  # a vLLM engine start alone takes longer here
    assert not (tmp / "run" / "revisions").exists()


def test_artifacts_hold_the_acceptance_table_and_the_mlflow_run(two_runs):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    first, *_ = two_runs
    table_key, link_key = artifact_key(first.config_name, "acceptance"), artifact_key(first.config_name, "mlflow-run")
    with get_client(sync_client=True) as client:
        table = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[table_key])))
        link = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[link_key])))
    assert table and "| p-eagle | 3 |" in table[0].data
    assert link and first.mlflow_run_id in link[0].data or any(first.mlflow_run_id in a.data for a in link)
