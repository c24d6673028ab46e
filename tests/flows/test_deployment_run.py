"""The pipeline deployment and the retraining deployment as a Prefect user runs them: the
session's real `prefect server`, a real process worker, prefect.yaml's deployments.

One pipeline deployment run pays for every test here: `prefect work-pool create`, `prefect
deploy --name pipeline-demo`, `prefect worker start`, `prefect deployment run` with tiny.yaml
at its smallest as parameters, with a prompt file and a ``kind: magpie`` source (the data
stage writes the magpie file) as configs/demo.yaml has. Then, through the Prefect API: the
flow run completed, every stage's logs are there (training steps included), no run stored a
credential-bearing parameter, the artifacts exist, the head is registered in MLflow, whose URI
reaches the worker only through its environment (MLFLOW_TRACKING_URI); a `peagle run` of the
same config from the CLI reuses what the worker cached.

Then the retraining deployment on an interval schedule, fired by the server and run by the
same worker:

1. the first tick finds nothing new: its "nothing new" artifact, no stage subflow, no task but
   the target's, no engine started;
2. after the prompt file grows, a tick retrains and names that file; the gate refuses the
   challenger (a promotion margin no head beats);
3. the next tick does not retrain those inputs again.

Ticks that come while a retraining runs are cancelled (prefect.yaml's concurrency limit).
The tests run in file order: the schedule's tests grow the prompt file the others read.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
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
NAME = "deployed"  # the config's name: its runs are "<stage> deployed (embedded)"
PROMPTS, MAGPIE, HELDOUT, NEW_PROMPTS, TRAIN_STEPS = 24, 4, 4, 4, 4
INTERVAL_S = 20
TICK_TIMEOUT_S = 900


def shrunk_overrides(tmp: Path) -> dict:
    """tiny.yaml at its smallest (a few training steps, one K, 4 eval prompts), with a prompt
    file and a magpie source, as configs/demo.yaml has."""
    return {
        "name": NAME,
        "workdir": str(tmp / "run"),
        "data.sources": [{"kind": "jsonl", "path": str(tmp / "prompts.jsonl"), "schema": "messages"},
                         {"kind": "magpie", "path": str(tmp / "magpie.jsonl"), "max_samples": MAGPIE}],
        "data.max_samples": None,
        "data.heldout_samples": HELDOUT,
        "data.regenerate.max_tokens": 48,
        "drafter.num_layers": 1,
        "train.recipe.max_steps": TRAIN_STEPS,
        "train.baseline.eagle3": False,
        "eval.ks": [2],
        "eval.num_prompts": 4,
        "eval.max_tokens": 32,
        "eval.offline_max_samples": 4,
    }


def retrain_overrides(tmp: Path) -> dict:
    """The same inputs; a promotion margin no head beats, so the gate refuses the challenger, and
    two Ks (evaluation is no input), so the evaluation shows the champion served at the largest alone."""
    return {**shrunk_overrides(tmp), "tracking.promotion_margin": 1000.0, "eval.ks": [1, 2]}


@dataclass
class Deployed:
    env: dict
    tmp: Path
    worker: object
    run: object  # the pipeline deployment's flow run

    @property
    def prompts(self) -> Path:
        return self.tmp / "prompts.jsonl"

    @property
    def magpie(self) -> Path:
        return self.tmp / "magpie.jsonl"


@pytest.fixture(scope="module")
def deployed(tmp_path_factory, embedded_target, prefect_server):
    """The pipeline deployment run once by a worker, which keeps running for the schedule."""
    tmp = tmp_path_factory.mktemp("deployment-run")
    lines = (REPO / "data" / "prompts" / "code_train.jsonl").read_text().splitlines()[:PROMPTS]
    (tmp / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    with deployed_on_this_server({POOL}, DEPLOYMENTS):
        env = worker_env(prefect_server, tmp)  # the worker polls the session's server; this process reads it
        prefect_cli(["work-pool", "create", POOL, "--type", "process"], env)
        prefect_cli(["--no-prompt", "deploy", "--name", "pipeline-demo"], env, cwd=REPO)
        with prefect_worker(POOL, env, tmp / "worker.log", cwd=REPO) as worker:
            start = time.perf_counter()
            run_id = start_deployment_run("peagle-pipeline/pipeline-demo",
                                          {"config_path": "configs/tiny.yaml", "overrides": shrunk_overrides(tmp)}, env)
            run = wait_for_flow_run(run_id, timeout_s=2400, worker=worker)
            print(f"\npipeline deployment run {run.name} ({run_id}): {run.state_name} "
                  f"after {time.perf_counter() - start:.0f} s")
            yield Deployed(env, tmp, worker, run)


def task_run_names(client, flow_runs) -> set[str]:
    """The names of the task runs of these flow runs (the server holds the whole session's)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    return {t.name for t in client.read_task_runs(
        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[r.id for r in flow_runs])))}


def stage_runs(client, run) -> dict:
    """The pipeline's subflow runs by name."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id])))
    return {r.name: r for r in children}


def test_the_deployment_run_completes_with_named_stage_runs(deployed):
    run, tmp = deployed.run, deployed.tmp
    from prefect.client.orchestration import get_client

    assert run.state.is_completed(), (run.state.message, (tmp / "worker.log").read_text()[-4000:])
    assert run.name == "pipeline deployed (embedded)"
    with get_client(sync_client=True) as client:
        children = stage_runs(client, run)
        assert set(children) == {"data deployed (embedded)", "train-peagle deployed (embedded)",
                                 "evaluate deployed (embedded)", "publish deployed (embedded)"}
        assert all(r.state.is_completed() for r in children.values())
        task_names = task_run_names(client, [run, *children.values()])
        assert {"train-peagle", "evaluate-offline-peagle", "export-peagle"} <= task_names, task_names
        for prefix in ("resolve-target-", "generate-data-", "evaluate-online-", "register-and-gate-"):
            assert any(n.startswith(prefix) for n in task_names), (prefix, task_names)
        limit = client.read_global_concurrency_limit_by_name("peagle-accelerator")  # made by the first run
        assert limit.limit == 1 and limit.active_slots == 0
        # Prefect stores every flow run's parameters: none holds a config or a tracking URI
        for r in [run, *children.values()]:
            stored = json.dumps(r.parameters)
            assert "mlflow.db" not in stored and "tracking" not in stored, (r.name, stored)
        assert children["train-peagle deployed (embedded)"].parameters["config"].endswith("config.resolved.json")


def test_every_stage_logs_into_the_run_including_training_steps(deployed):
    run, tmp = deployed.run, deployed.tmp
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        children = stage_runs(client, run)
        logs = logs_of_finished_runs(client, [run.id, *(r.id for r in children.values())])
    by_run = {}
    for record in logs:
        by_run.setdefault(record.flow_run_id, []).append(record.message)
    text = {name: "\n".join(by_run.get(r.id, [])) for name, r in children.items()}
    print("\n".join(f"{r.name:>14} | {r.message[:110]}" for r in logs if r.name.startswith("peagle"))[:6000])

    pipeline = "\n".join(by_run[run.id])
    assert "library output (vLLM, DeepSpeed, torch) goes to" in pipeline
    assert "target embedded: " in pipeline and "(revision local:" in pipeline
    assert f"{PROMPTS + MAGPIE - HELDOUT} train + {HELDOUT} held-out prompts" in text["data deployed (embedded)"]
    assert "starting vLLM" in text["data deployed (embedded)"]
    train = text["train-peagle deployed (embedded)"]
    assert f"train peagle: step 1/{TRAIN_STEPS}, loss " in train and "tokens/s, ETA " in train
    assert f"train peagle: step {TRAIN_STEPS}/{TRAIN_STEPS}, loss " in train
    assert "offline acceptance" in train
    assert "online eval: starting engine" in text["evaluate deployed (embedded)"]
    assert "| p-eagle | 2 |" in text["evaluate deployed (embedded)"]
    assert "registered deployed version 1" in text["publish deployed (embedded)"]
    # the libraries' output is in the run directory, not in our logs
    library_log = (tmp / "run" / "logs" / "libraries.log").read_text()
    assert "vllm" in library_log.lower()
    assert all("vllm" not in r.name for r in logs)
    [training] = (tmp / "run" / "checkpoints" / "peagle").iterdir()  # one head identity trained
    assert (training / "train.log").stat().st_size > 0  # the ranks' output


def test_artifacts_and_the_registered_head(deployed):
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        artifacts = {a.key: a for a in client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["deployed-acceptance", "deployed-mlflow-run"])))}
    assert "| p-eagle | 2 | 1 |" in artifacts["deployed-acceptance"].data
    client = MlflowClient(tracking_uri=deployed.env["MLFLOW_TRACKING_URI"])
    champion = client.get_model_version_by_alias("peagle-embedded", "champion")
    assert champion.run_id in artifacts["deployed-mlflow-run"].data
    files = {Path(f.path).name for f in client.list_artifacts(champion.run_id, "heads/peagle")}
    assert {"config.json", "model.safetensors"} <= files, files


def test_a_cli_run_afterwards_reuses_what_the_worker_cached(deployed):
    """`peagle run` with the same config, from another Prefect setting (its own ephemeral API):
    data, training and online evaluation come from the cache the worker's run left."""
    import subprocess
    import sys

    env, tmp = deployed.env, deployed.tmp
    run_dir = tmp / "run"
    [training] = (run_dir / "checkpoints" / "peagle").iterdir()  # one head identity trained
    watched = [run_dir / "data" / "samples.jsonl", training / "metrics.jsonl", training / "train_result.json"]
    before = {p: p.stat().st_mtime_ns for p in watched}
    cli_env = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}
    cli_env["PREFECT_HOME"] = str(tmp / "cli-prefect-home")
    cli_env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "300"  # 2 loaded cores
    sets = [f"--set={k}={json.dumps(v)}" for k, v in shrunk_overrides(tmp).items()]
    start = time.perf_counter()
    proc = subprocess.run([str(Path(sys.executable).with_name("peagle")), "run", "configs/tiny.yaml", *sets],
                          env={**cli_env, "COLUMNS": "200"}, cwd=REPO, capture_output=True, text=True, timeout=1200)
    seconds = time.perf_counter() - start
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    print(f"\nCLI rerun after the worker's run: {seconds:.0f} s")
    for task in ("generate-data", "train-peagle", "evaluate-online"):
        assert any(task in line and "Cached" in line for line in output.splitlines()), (task, output[-4000:])
    assert {p: p.stat().st_mtime_ns for p in watched} == before  # nothing rebuilt or retrained
    assert os.path.isdir(tmp / "cli-prefect-home")  # it did run on a Prefect of its own


# ----------------------------------------------------------------------------- the retraining schedule


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


def samples(run: Path) -> dict[str, dict]:
    lines = (run / "data" / "samples.jsonl").read_text().splitlines()
    return {d["id"]: d for d in map(json.loads, lines)}


def check_the_retrained_revision(deployed: Deployed, before: dict[str, dict], logs: str) -> None:
    """What the retraining tick left, as its user reads it back: only the new prompts were
    regenerated; a revision directory of its own on the grown dataset; the champion measured beside
    the new head in the same vLLM run, at the largest K alone, and the gate decided on that; the
    new head warm-started from the champion, and its card states its own acceptance."""
    from mlflow import MlflowClient

    from peagle.config import load_config
    from peagle.contract import NGRAM
    from peagle.eval.online import OnlineResult
    from peagle.layout import ONLINE_RESULTS_FILE, TRAIN_RESULT_FILE
    from peagle.publish.gate import head_score

    run = deployed.tmp / "run"
    after = samples(run)
    new_ids = set(after) - set(before)
    assert len(new_ids) == NEW_PROMPTS, sorted(new_ids)
    assert all(after[i]["regen"] == "ok" for i in new_ids)
    kept = sum(1 for i, d in before.items() if after[i]["split"] == d["split"])  # restored, not regenerated
    restored = re.search(r"(\d+) regenerated responses restored", logs)
    assert restored and int(restored.group(1)) == kept >= PROMPTS // 2, (kept, logs[-3000:])
    [revision] = (run / "revisions").iterdir()

    online = OnlineResult.load(revision / "eval" / ONLINE_RESULTS_FILE)
    label = "champion-v1"
    assert online.heads() == ["p-eagle", label] and NGRAM in online.methods()  # n-gram lookup: the floor
    rows = {m: [(r.k, r.concurrency, r.requests) for r in online.rows if r.method == m] for m in online.heads()}
    assert [k for k, _, _ in rows["p-eagle"]] == [1, 2]
    assert rows[label] == [r for r in rows["p-eagle"] if r[0] == 2]  # the champion at the gate's K, same prompts
    assert all(r.num_drafts > 0 for r in online.rows if r.method == label)
    client = MlflowClient(tracking_uri=deployed.env["MLFLOW_TRACKING_URI"])
    champion, new = client.get_model_version("peagle-embedded", "1"), client.get_model_version("peagle-embedded", "2")
    cfg = load_config(REPO / "configs" / "tiny.yaml", retrain_overrides(deployed.tmp))
    assert float(new.tags["peagle.score"]) == head_score(cfg, online, "p-eagle")
    assert float(new.tags["peagle.promotion.champion_score"]) == head_score(cfg, online, label)
    assert str(client.get_model_version_by_alias("peagle-embedded", "champion").version) == "1"
    assert json.loads(new.tags["peagle.lineage.prompt_files"]) != json.loads(champion.tags["peagle.lineage.prompt_files"])
    card = (revision / "heads" / "peagle" / "README.md").read_text()
    assert label not in card and f"| 2 | {online.acceptance_by_k('p-eagle')[2]:.2f} |" in card

    [training] = (revision / "checkpoints" / "peagle").iterdir()
    warm = json.loads((training / TRAIN_RESULT_FILE).read_text())["warm_start"]
    assert Path(warm["head_dir"]).name == "v1" and warm["lm_head_rows_copied"] > 0, warm


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_dataset_records_the_magpie_file_it_read_and_nothing_is_new(deployed):
    """What the champion records is what the data stage read: the magpie file as written, not a
    hub dataset's name; the current inputs, named the same way, are the champion's."""
    from mlflow import MlflowClient

    from peagle.config import load_config
    from peagle.lineage import read_dataset_inputs, recorded_lineage
    from peagle.publish.gate import plan_retraining
    from peagle.stages import prepare_target

    written = [json.loads(line) for line in deployed.magpie.read_text().splitlines()]
    assert written and all(r["messages"][0]["role"] == "user" for r in written)
    read = json.loads(read_dataset_inputs(deployed.tmp / "run" / "data")["prompt_files"])
    assert read == {str(deployed.prompts): sha256_of(deployed.prompts), str(deployed.magpie): sha256_of(deployed.magpie)}
    champion = MlflowClient(tracking_uri=deployed.env["MLFLOW_TRACKING_URI"]).get_model_version_by_alias(
        "peagle-embedded", "champion")
    assert json.loads(recorded_lineage(champion)["prompt_files"]) == read
    cfg = load_config(REPO / "configs" / "tiny.yaml", {**shrunk_overrides(deployed.tmp),
                                                        "tracking.tracking_uri": deployed.env["MLFLOW_TRACKING_URI"]})
    plan = plan_retraining(cfg, prepare_target(cfg))
    assert not plan.retrain and plan.message.startswith(f"nothing new: champion v{champion.version}"), plan.message


# Three ticks of a real schedule, one of them a whole retraining (data, training, six engines in
# the evaluation, publish): about 350 s on 2 loaded cores.
@pytest.mark.timeout(1200)
def test_the_schedule_retrains_once_on_new_prompts_and_never_on_the_same_inputs(deployed):
    from prefect.client.orchestration import get_client

    params = {"config_path": "configs/tiny.yaml", "overrides": retrain_overrides(deployed.tmp), "force": False,
              "warm_start": True}
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
            before = samples(deployed.tmp / "run")
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
            check_the_retrained_revision(deployed, before, messages(client, [retrained, *child_runs(client, retrained)]))

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
