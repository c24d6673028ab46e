"""Scheduled retraining as its users run it: the retraining deployment of prefect.yaml on an
interval schedule, fired by the session's real `prefect server` and run by a real process worker.

First the pipeline deployment runs once on a config with a prompt file and a ``kind: magpie``
source (its data stage writes the magpie file), as `make demo` does. Then the schedule fires on
its own, and through the Prefect API:

1. the first tick finds nothing new: its "nothing new" artifact, no stage subflow, no task but
   the target's, no engine started;
2. after the prompt file grows, a tick retrains and names that file; the gate refuses the
   challenger (a promotion margin no head beats);
3. the next tick does not retrain those inputs again.

Ticks that come while a retraining runs are cancelled (prefect.yaml's concurrency limit).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest

from flows.common import artifact_key
from tests.prefect_worker import (
    deployed_on_this_server,
    logs_of_finished_runs,
    prefect_cli,
    prefect_worker,
    start_deployment_run,
    wait_for_flow_run,
    worker_env,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
POOL = "peagle-process"
DEPLOYMENTS = {"pipeline-demo", "retrain-demo"}  # what this module deploys from prefect.yaml
NAME = "scheduled"  # the config's name: its runs are "<stage> scheduled (embedded)"
PROMPTS, MAGPIE, HELDOUT, NEW_PROMPTS = 24, 4, 4, 4
INTERVAL_S = 20
TICK_TIMEOUT_S = 900


def scheduled_overrides(tmp: Path) -> dict:
    """tiny.yaml at its smallest, with a prompt file and a magpie source, as configs/demo.yaml has."""
    return {
        "name": NAME,
        "workdir": str(tmp / "run"),
        "data.sources": [{"kind": "jsonl", "path": str(tmp / "prompts.jsonl"), "schema": "messages"},
                         {"kind": "magpie", "path": str(tmp / "magpie.jsonl"), "max_samples": MAGPIE}],
        "data.max_samples": None,
        "data.heldout_samples": HELDOUT,
        "data.regenerate.max_tokens": 48,
        "drafter.num_layers": 1,
        "train.max_steps": 4,
        "train.eagle3_baseline": False,
        "eval.ks": [2],
        "eval.num_prompts": 4,
        "eval.max_tokens": 32,
        "eval.offline_max_samples": 4,
    }


def retrain_overrides(tmp: Path) -> dict:
    """The same config; a promotion margin no head beats, so the gate refuses the challenger."""
    return {**scheduled_overrides(tmp), "tracking.promotion_margin": 1000.0}


@dataclass
class Deployed:
    env: dict
    tmp: Path
    worker: object
    pipeline_run: object

    @property
    def prompts(self) -> Path:
        return self.tmp / "prompts.jsonl"

    @property
    def magpie(self) -> Path:
        return self.tmp / "magpie.jsonl"


@pytest.fixture(scope="module")
def deployed(tmp_path_factory, embedded_target, prefect_server):
    """The pipeline deployment run once by a worker, which keeps running for the schedule."""
    tmp = tmp_path_factory.mktemp("scheduled-retraining")
    lines = (REPO / "data" / "prompts" / "code_train.jsonl").read_text().splitlines()[:PROMPTS]
    (tmp / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    with deployed_on_this_server({POOL}, DEPLOYMENTS):
        env = worker_env(prefect_server, tmp)
        prefect_cli(["work-pool", "create", POOL, "--type", "process"], env)
        prefect_cli(["--no-prompt", "deploy", "--name", "pipeline-demo"], env, cwd=REPO)
        with prefect_worker(POOL, env, tmp / "worker.log", cwd=REPO) as worker:
            start = time.perf_counter()
            run_id = start_deployment_run("peagle-pipeline/pipeline-demo",
                                          {"config_path": "configs/tiny.yaml", "overrides": scheduled_overrides(tmp)},
                                          env)
            run = wait_for_flow_run(run_id, timeout_s=2400, worker=worker)
            print(f"\npipeline deployment run with a magpie source: {run.state_name} after "
                  f"{time.perf_counter() - start:.0f} s")
            assert run.state.is_completed(), (run.state.message, (tmp / "worker.log").read_text()[-4000:])
            yield Deployed(env, tmp, worker, run)


# ----------------------------------------------------------------------------- reading the API


def retrain_deployment(client):
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    return client.read_deployments(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["retrain-demo"])))[0]


def ticks(client, deployment) -> list:
    """The runs the schedule made of ``deployment``, oldest first."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])))
    return sorted((r for r in runs if r.auto_scheduled), key=lambda r: r.expected_start_time)


def retrain_artifact(client, run) -> str:
    """The retraining decision the tick ``run`` published (its Prefect artifact)."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    found = client.read_artifacts(artifact_filter=ArtifactFilter(
        key=ArtifactFilterKey(any_=[artifact_key(NAME, "retrain")]), flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
    assert len(found) == 1, (run.name, run.state_name, [a.data for a in found])
    return found[0].data


def next_completed_tick(client, deployment, started_after: datetime, worker):
    """The first tick that started after ``started_after`` and completed (ticks cancelled by the
    concurrency limit are skipped; a failed one fails the test)."""
    deadline = time.monotonic() + TICK_TIMEOUT_S
    while True:
        for run in ticks(client, deployment):
            if run.start_time is None or run.start_time <= started_after or run.state is None:
                continue
            assert not run.state.is_failed() and not run.state.is_crashed(), (run.name, run.state.message)
            if run.state.is_completed():
                return run
        assert worker.poll() is None, "the worker exited"
        assert time.monotonic() < deadline, [(r.name, r.state_name) for r in ticks(client, deployment)]
        time.sleep(3)


def child_runs(client, run) -> list:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    return client.read_flow_runs(flow_run_filter=FlowRunFilter(
        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id])))


def task_names(client, run) -> set[str]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    return {t.name.rsplit("-", 1)[0] for t in client.read_task_runs(
        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))}


def messages(client, runs) -> str:
    return "\n".join(r.message for r in logs_of_finished_runs(client, [r.id for r in runs]))


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ----------------------------------------------------------------------------- the tests


def test_the_dataset_records_the_magpie_file_it_read_and_nothing_is_new(deployed):
    """What the champion records is what the data stage read: the magpie file as written, not a
    hub dataset's name; the current inputs, named the same way, are the champion's."""
    from mlflow import MlflowClient

    from peagle.config import load_config
    from peagle.lineage import read_dataset_inputs, recorded_lineage
    from peagle.stages import prepare_target
    from peagle.tracking.gate import plan_retraining

    written = [json.loads(line) for line in deployed.magpie.read_text().splitlines()]
    assert written and all(r["messages"][0]["role"] == "user" for r in written)
    read = json.loads(read_dataset_inputs(deployed.tmp / "run" / "data")["prompt_files"])
    assert read == {str(deployed.prompts): sha256_of(deployed.prompts), str(deployed.magpie): sha256_of(deployed.magpie)}
    champion = MlflowClient(tracking_uri=deployed.env["MLFLOW_TRACKING_URI"]).get_model_version_by_alias(
        "peagle-embedded", "champion")
    assert json.loads(recorded_lineage(champion)["prompt_files"]) == read
    cfg = load_config(REPO / "configs" / "tiny.yaml", {**scheduled_overrides(deployed.tmp),
                                                        "tracking.tracking_uri": deployed.env["MLFLOW_TRACKING_URI"]})
    plan = plan_retraining(cfg, prepare_target(cfg))
    assert not plan.retrain and plan.message.startswith(f"nothing new: champion v{champion.version}"), plan.message


def test_the_schedule_retrains_once_on_new_prompts_and_never_on_the_same_inputs(deployed):
    from prefect.client.orchestration import get_client

    params = {"config_path": "configs/tiny.yaml", "overrides": retrain_overrides(deployed.tmp), "force": False,
              "warm_start": False}
    prefect_cli(["--no-prompt", "deploy", "--name", "retrain-demo", "--interval", str(INTERVAL_S),
                 "--params", json.dumps(params)], deployed.env, cwd=REPO)
    with get_client(sync_client=True) as client:
        deployment = retrain_deployment(client)
        try:
            intervals = [s.schedule.interval.total_seconds() for s in deployment.schedules
                         if getattr(s.schedule, "interval", None)]  # beside prefect.yaml's nightly cron
            assert intervals == [INTERVAL_S]
            assert deployment.global_concurrency_limit.limit == 1  # prefect.yaml: one retraining at a time
            assert deployment.concurrency_options.collision_strategy == "CANCEL_NEW"
            deployed_at = datetime.now(UTC)

            # 1. nothing changed since the pipeline run: nothing new, nothing started
            start = time.perf_counter()
            first = next_completed_tick(client, deployment, deployed_at, deployed.worker)
            print(f"\nfirst tick {first.name}: completed {time.perf_counter() - start:.0f} s after the deploy, "
                  f"ran {first.total_run_time.total_seconds():.0f} s")
            decision = retrain_artifact(client, first)
            assert "nothing new: champion v1 was trained on these inputs" in decision, decision
            assert child_runs(client, first) == []  # no data, train, evaluate or publish stage
            assert task_names(client, first) == {"resolve-target"}
            logs = messages(client, [first])
            assert "nothing new" in logs and "starting vLLM" not in logs and "starting engine" not in logs, logs

            # 2. the prompt file grows: the next tick retrains on it, and the gate refuses the head
            lines = (REPO / "data" / "prompts" / "code_train.jsonl").read_text().splitlines()
            with open(deployed.prompts, "a") as fh:
                fh.write("\n".join(lines[PROMPTS:PROMPTS + NEW_PROMPTS]) + "\n")
            grown = datetime.now(UTC)
            start = time.perf_counter()
            retrained = next_completed_tick(client, deployment, grown, deployed.worker)
            print(f"retraining tick {retrained.name}: completed {time.perf_counter() - start:.0f} s after the "
                  f"prompt file grew, ran {retrained.total_run_time.total_seconds():.0f} s")
            decision = retrain_artifact(client, retrained)
            assert (f"retrained on: prompt file {deployed.prompts} changed (new prompt data). Version 2: refused: "
                    "score ") in decision and decision.endswith("(must be strictly greater)"), decision
            stages = {r.name for r in child_runs(client, retrained)}
            assert f"data {NAME} (embedded)" in stages and f"publish {NAME} (embedded)" in stages, stages

            # 3. the next tick finds the refused challenger trained on exactly these inputs
            after = next_completed_tick(client, deployment, retrained.end_time, deployed.worker)
            decision = retrain_artifact(client, after)
            assert "nothing new: v2 (refused: score" in decision, decision
            assert child_runs(client, after) == [] and task_names(client, after) == {"resolve-target"}
        finally:
            client.pause_deployment(deployment.id)
        every = ticks(client, deployment)
        completed = [r for r in every if r.state is not None and r.state.is_completed()]
        decisions = [retrain_artifact(client, r) for r in completed]
    assert sum("retrained on:" in d for d in decisions) == 1, decisions  # one retraining, however many ticks
    print(f"{len(every)} ticks: " + ", ".join(f"{r.state_name}" for r in every))
