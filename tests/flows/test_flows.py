"""The Prefect flows on the embedded default, for real, under Prefect's test harness.

One module-scoped harness and one tiny config shared by every test (the CPU is shared):
a first pipeline run, a second with unchanged inputs (data, training and online
evaluation come from the cache), a retraining run with nothing new (does nothing), and
one after new prompts were appended (regenerates only what it lacks, promotes only when
better).
"""

import json
import re
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
FIRST_PROMPTS, NEW_PROMPTS = 40, 8


def tiny_overrides(tmp: Path) -> dict:
    """demo.yaml shrunk to the smallest run that still exercises every code path."""
    return {
        "name": "flows",
        "workdir": str(tmp / "run"),
        "tracking.tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}",
        "data.sources": [{"kind": "jsonl", "path": str(tmp / "prompts.jsonl"), "schema": "messages"}],
        "data.max_samples": None,
        "data.heldout_samples": 8,
        "data.regenerate.max_tokens": 64,
        "drafter.num_layers": 1,
        "train.epochs": 1,
        "train.eagle3_baseline": False,  # one trained head per run (tests/test_pipeline_e2e.py covers the baseline)
        "eval.ks": [2],
        "eval.num_prompts": 4,
        "eval.max_tokens": 32,
    }


def prompt_lines() -> list[str]:
    return (REPO / "data" / "prompts" / "code_train.jsonl").read_text().splitlines()


def samples(run: Path) -> dict[str, dict]:
    lines = (run / "data" / "samples.jsonl").read_text().splitlines()
    return {d["id"]: d for d in map(json.loads, lines)}


@pytest.fixture(scope="module")
def harness(prefect_server):
    """Prefect's test server; cache keys include the run directory, so a tmp run never hits an old one."""
    yield


@pytest.fixture(scope="module")
def setup(tmp_path_factory, embedded_target, harness):
    tmp = tmp_path_factory.mktemp("flows")
    (tmp / "prompts.jsonl").write_text("\n".join(prompt_lines()[:FIRST_PROMPTS]) + "\n")
    return tmp, tiny_overrides(tmp)


@pytest.fixture(scope="module")
def two_runs(setup):
    """The same pipeline twice: the second finds every expensive input unchanged."""
    from flows.pipeline import pipeline_flow

    tmp, overrides = setup
    config = str(REPO / "configs" / "demo.yaml")
    start = time.perf_counter()
    first = pipeline_flow(config, overrides)
    first_s = time.perf_counter() - start
    data_files = {p: p.stat().st_mtime_ns for p in (tmp / "run" / "data").rglob("*") if p.is_file()}
    start = time.perf_counter()
    second = pipeline_flow(config, overrides)
    second_s = time.perf_counter() - start
    print(f"\npipeline: first run {first_s:.1f} s, second (cached) {second_s:.1f} s; "
          f"stages first {first.stage_seconds}, second {second.stage_seconds}")
    return first, second, first_s, second_s, data_files


def task_run_states(name: str) -> list[str]:
    """State names of every run of task ``name``, oldest first (read from the Prefect API)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        runs = [r for r in client.read_task_runs() if r.name.rsplit("-", 1)[0] == name]  # run names: "<task>-<n>"
    return [r.state.name for r in sorted(runs, key=lambda r: r.expected_start_time)]


def flow_run_names_completed() -> set[str]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        flows = {f.id: f.name for f in client.read_flows()}
        return {flows[r.flow_id] for r in client.read_flow_runs() if r.state and r.state.is_completed()}


def test_pipeline_composes_every_stage_flow(two_runs):
    first, _, _, _, _ = two_runs
    assert {"peagle-pipeline", "peagle-data", "peagle-train", "peagle-evaluate", "peagle-publish"} <= \
        flow_run_names_completed()
    assert (Path(first.head_dir) / "model.safetensors").exists()
    assert first.online.acceptance_by_k("p-eagle")[2] > 1.0
    assert first.model_version == "1" and first.promotion.promoted


def test_second_run_reuses_the_cached_dataset_and_is_faster(two_runs):
    first, second, first_s, second_s, data_files = two_runs
    assert task_run_states("generate-data")[:2] == ["Completed", "Cached"]
    assert task_run_states("train")[:2] == ["Completed", "Cached"]
    assert task_run_states("evaluate-online")[:2] == ["Completed", "Cached"]
    after = {p: p.stat().st_mtime_ns for p in data_files}
    assert after == data_files  # not one dataset file rewritten
    assert second.data_dir == first.data_dir
    assert second.online.acceptance_by_k("p-eagle") == first.online.acceptance_by_k("p-eagle")
    assert second_s < first_s / 2


def test_an_unchanged_rerun_registers_no_new_version(two_runs):
    first, second, _, _, _ = two_runs
    assert second.model_version == first.model_version and not second.promotion.promoted


def test_lineage_is_recorded_on_the_registered_version(two_runs, setup):
    from mlflow import MlflowClient

    first, *_ = two_runs
    tmp, _ = setup
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")
    tags = client.get_model_version("peagle-embedded", first.model_version).tags
    prompt_files = json.loads(tags["peagle.lineage.prompt_files"])
    assert list(prompt_files) == [str(tmp / "prompts.jsonl")]
    assert tags["peagle.lineage.data_config_hash"] == first.lineage["data_config_hash"]
    assert tags["peagle.lineage.target_revision"].startswith("local:")
    assert "train" in tags["peagle.lineage.data_manifests"]


def test_retraining_with_nothing_new_does_nothing(two_runs, setup):
    from flows.retrain import retrain_flow

    tmp, overrides = setup
    start = time.perf_counter()
    result = retrain_flow(str(REPO / "configs" / "demo.yaml"), overrides)
    seconds = time.perf_counter() - start
    print(f"\nretrain with nothing new: {seconds:.1f} s")
    assert not result.retrained and result.pipeline is None
    assert "nothing new" in result.message
    assert seconds < 45  # a vLLM engine start alone takes longer here
    assert not (tmp / "run" / "revisions").exists()


def test_retraining_on_new_prompts_regenerates_only_them_and_gates_promotion(two_runs, setup, caplog):
    from mlflow import MlflowClient

    from flows.retrain import retrain_flow

    tmp, overrides = setup
    before = samples(tmp / "run")
    with open(tmp / "prompts.jsonl", "a") as fh:
        fh.write("\n".join(prompt_lines()[FIRST_PROMPTS:FIRST_PROMPTS + NEW_PROMPTS]) + "\n")
    caplog.set_level("INFO", logger="peagle")
    caplog.clear()
    start = time.perf_counter()
    result = retrain_flow(str(REPO / "configs" / "demo.yaml"), overrides, warm_start=True)
    seconds = time.perf_counter() - start
    out = caplog.text  # peagle's log lines (the data stage's included)
    print(f"\nretrain on {NEW_PROMPTS} new prompts (warm start): {seconds:.1f} s; {result.message}")

    assert result.retrained and any("prompt file" in c for c in result.changes)
    after = samples(tmp / "run")
    new_ids = set(after) - set(before)
    assert len(new_ids) == NEW_PROMPTS
    # regenerated responses of prompts already done (same split) were restored, not regenerated
    kept = sum(1 for i, d in before.items() if after[i]["split"] == d["split"])
    restored = int(re.search(r"(\d+) regenerated responses restored", out).group(1))
    assert restored == kept and kept >= FIRST_PROMPTS // 2
    for i in new_ids:
        assert after[i]["regen"] == "ok"
    # a new revision directory; the shared dataset grew
    assert Path(result.pipeline.head_dir).is_relative_to(tmp / "run" / "revisions")
    assert result.pipeline.data_dir == str(tmp / "run" / "data")

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")
    champion_before = client.get_model_version("peagle-embedded", result.champion_before)
    new = client.get_model_version("peagle-embedded", result.pipeline.model_version)
    better = float(new.tags["peagle.score"]) > float(champion_before.tags["peagle.score"])
    assert result.pipeline.promotion.promoted == better
    champion = client.get_model_version_by_alias("peagle-embedded", "champion")
    assert champion.version == (new.version if better else champion_before.version)
    assert json.loads(new.tags["peagle.lineage.prompt_files"]) != json.loads(
        champion_before.tags["peagle.lineage.prompt_files"])

    # warm-started from the champion it replaces: its first steps start from the champion's loss
    revision = Path(result.pipeline.checkpoint_dir).parent
    warm = json.loads((revision / "train_result.json").read_text())["warm_start"]
    assert Path(warm["head_dir"]).name == f"v{champion_before.version}"
    assert warm["lm_head_rows_copied"] > 0
    first_loss = [r["loss"] for r in map(json.loads, (tmp / "run" / "checkpoints" / "peagle" / "metrics.jsonl")
                                         .read_text().splitlines()) if "loss" in r][0]
    warm_loss = [r["loss"] for r in map(json.loads, (revision / "metrics.jsonl").read_text().splitlines())
                 if "loss" in r][0]
    assert warm_loss < 0.8 * first_loss, (warm_loss, first_loss)


def test_retraining_again_on_the_same_inputs_does_nothing(two_runs, setup):
    """Whether or not the gate promoted the retrained head, its inputs are already trained on."""
    from flows.retrain import retrain_flow

    _, overrides = setup
    result = retrain_flow(str(REPO / "configs" / "demo.yaml"), overrides)
    assert not result.retrained and "nothing new" in result.message


def test_artifacts_hold_the_acceptance_table_and_the_mlflow_run(two_runs):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    first, *_ = two_runs
    with get_client(sync_client=True) as client:
        table = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["flows-acceptance"])))
        link = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["flows-mlflow-run"])))
    assert table and "| p-eagle | 2 |" in table[0].data
    assert link and first.mlflow_run_id in link[0].data or any(first.mlflow_run_id in a.data for a in link)
