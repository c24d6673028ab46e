"""The Prefect flows on the embedded default, for real, on the shared pipeline run.

The first run is ``tests/conftest.py::pipeline_run`` (shared with the end-to-end tests);
here: a second run with unchanged inputs (data, training and online evaluation come from
the cache), the head published alone into another registry (its lineage goes with it), a
retraining run with nothing new (does nothing), and one after new prompts were appended
(regenerates only what it lacks; the champion is measured beside the new head in the same
vLLM run, and promotion is decided on that comparison).
"""

import json
import re
import time
from pathlib import Path

import pytest

from flows.common import artifact_key
from peagle.config import load_config
from peagle.contract import NGRAM
from peagle.lineage import read_head_lineage, recorded_lineage
from peagle.tracking.gate import head_score

pytestmark = pytest.mark.slow

NEW_PROMPTS = 8


def retrain_overrides(run) -> dict:
    """The shared run's config, without the EAGLE-3 baseline: retraining trains one head
    (the shared run covers the baseline), which the lineage records as a config change too.
    Two Ks, so the evaluation shows the champion served at the largest alone."""
    return {**run.overrides, "train.eagle3_baseline": False, "eval.ks": [1, 3]}


def samples(run: Path) -> dict[str, dict]:
    lines = (run / "data" / "samples.jsonl").read_text().splitlines()
    return {d["id"]: d for d in map(json.loads, lines)}


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


def test_retraining_on_new_prompts_regenerates_only_them_and_gates_promotion(two_runs, pipeline_run, caplog):
    from mlflow import MlflowClient

    from flows.retrain import retrain_flow

    tmp = pipeline_run.tmp
    before = samples(tmp / "run")
    pipeline_run.append_new_prompts(NEW_PROMPTS)
    caplog.set_level("INFO", logger="peagle")
    caplog.clear()
    start = time.perf_counter()
    result = retrain_flow(pipeline_run.config, retrain_overrides(pipeline_run), warm_start=True)
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
    assert restored == kept and kept >= pipeline_run.first_prompts // 2
    for i in new_ids:
        assert after[i]["regen"] == "ok"
    # a new revision directory; the shared dataset grew
    assert Path(result.pipeline.head_dir).is_relative_to(tmp / "run" / "revisions")
    assert result.pipeline.data_dir == str(tmp / "run" / "data")

    # the gate measured the champion beside the new head, in the same vLLM run, and decided on that
    client = MlflowClient(tracking_uri=pipeline_run.overrides["tracking.tracking_uri"])
    champion_before = client.get_model_version("peagle-embedded", result.champion_before)
    new = client.get_model_version("peagle-embedded", result.pipeline.model_version)
    online, label = result.pipeline.online, f"champion-v{champion_before.version}"
    assert online.heads() == ["p-eagle", label] and NGRAM in online.methods()  # n-gram lookup: the floor
    rows = {m: [(r.k, r.concurrency, r.requests) for r in online.rows if r.method == m] for m in online.heads()}
    cfg = load_config(pipeline_run.config, retrain_overrides(pipeline_run))
    assert [k for k, _, _ in rows["p-eagle"]] == cfg.eval.ks == [1, 3]
    # the champion on one engine, at the K the gate compares (the largest), on the same prompts
    assert rows[label] == [r for r in rows["p-eagle"] if r[0] == 3]
    assert all(r.num_drafts > 0 for r in online.rows if r.method == label)
    score, champion_score = head_score(cfg, online, "p-eagle"), head_score(cfg, online, label)
    assert float(new.tags["peagle.score"]) == score
    assert float(new.tags["peagle.promotion.champion_score"]) == champion_score
    better = score > champion_score * (1 + cfg.tracking.promotion_margin)
    assert result.pipeline.promotion.promoted == better, result.pipeline.promotion.reason
    assert "measured in the same run" in result.pipeline.promotion.reason
    first_cfg = load_config(pipeline_run.config, pipeline_run.overrides)  # the champion's own-run score: history
    assert float(champion_before.tags["peagle.score"]) == head_score(first_cfg, pipeline_run.result.online, "p-eagle")
    champion = client.get_model_version_by_alias("peagle-embedded", "champion")
    assert champion.version == (new.version if better else champion_before.version)
    assert json.loads(new.tags["peagle.lineage.prompt_files"]) != json.loads(
        champion_before.tags["peagle.lineage.prompt_files"])
    # the new head's card states its own acceptance, not the champion's
    card = (Path(result.pipeline.head_dir) / "README.md").read_text()
    assert label not in card
    assert f"| 3 | {online.acceptance_by_k('p-eagle')[3]:.2f} |" in card

    # warm-started from the champion it replaces: its first steps start from the champion's loss
    revision = Path(result.pipeline.checkpoint_dir).parent
    warm = json.loads((revision / "train_result.json").read_text())["warm_start"]
    assert Path(warm["head_dir"]).name == f"v{champion_before.version}"
    assert warm["lm_head_rows_copied"] > 0
    first_training = Path(pipeline_run.result.checkpoint_dir).parent  # checkpoints/peagle/<identity>
    first_loss = [r["loss"] for r in map(json.loads, (first_training / "metrics.jsonl")
                                         .read_text().splitlines()) if "loss" in r][0]
    warm_loss = [r["loss"] for r in map(json.loads, (revision / "metrics.jsonl").read_text().splitlines())
                 if "loss" in r][0]
    assert warm_loss < 0.8 * first_loss, (warm_loss, first_loss)


def test_retraining_again_on_the_same_inputs_does_nothing(two_runs, pipeline_run):
    """Whether or not the gate promoted the retrained head, its inputs are already trained on."""
    from flows.retrain import retrain_flow

    result = retrain_flow(pipeline_run.config, retrain_overrides(pipeline_run))
    assert not result.retrained and "nothing new" in result.message


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
