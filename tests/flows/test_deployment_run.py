"""A pipeline deployment run as a Prefect user runs it: a real server, a real process worker.

The session's `prefect server start` (tests/conftest.py), `prefect work-pool create`,
`prefect deploy --name pipeline-demo` from the repo's prefect.yaml, `prefect worker start`,
`prefect deployment run` with a shrunk config as parameters. Then, through the
Prefect API: the flow run completed, every stage's logs are there (training steps
included), no run stored a credential-bearing parameter, the artifacts exist, the head is
registered in MLflow. MLflow's URI reaches the worker only through its environment
(MLFLOW_TRACKING_URI). The retraining deployment on a schedule: tests/flows/test_scheduled_retraining.py.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

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
DEPLOYMENTS = {"pipeline-demo"}  # what this module deploys from prefect.yaml
PROMPTS, HELDOUT, TRAIN_STEPS = 24, 4, 4


def shrunk_overrides(tmp: Path) -> dict:
    """tiny.yaml at its smallest: a few training steps, one K, 4 eval prompts."""
    return {
        "name": "deployed",
        "workdir": str(tmp / "run"),
        "data.sources": [{"kind": "jsonl", "path": str(tmp / "prompts.jsonl"), "schema": "messages"}],
        "data.max_samples": None,
        "data.heldout_samples": HELDOUT,
        "data.regenerate.max_tokens": 48,
        "drafter.num_layers": 1,
        "train.max_steps": TRAIN_STEPS,
        "train.eagle3_baseline": False,
        "eval.ks": [2],
        "eval.num_prompts": 4,
        "eval.max_tokens": 32,
        "eval.offline_max_samples": 4,
    }


@pytest.fixture(scope="module")
def deployed_run(tmp_path_factory, embedded_target, prefect_server):
    """The pipeline deployment run by a worker; yields (server, env, flow run, tmp, worker)."""
    tmp = tmp_path_factory.mktemp("deployment-run")
    lines = (REPO / "data" / "prompts" / "code_train.jsonl").read_text().splitlines()[:PROMPTS]
    (tmp / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    server = prefect_server  # the worker polls the session's server; this process reads it
    with deployed_on_this_server({POOL}, DEPLOYMENTS):
        env = worker_env(server, tmp)
        prefect_cli(["work-pool", "create", POOL, "--type", "process"], env)
        prefect_cli(["--no-prompt", "deploy", "--name", "pipeline-demo"], env, cwd=REPO)
        with prefect_worker(POOL, env, tmp / "worker.log", cwd=REPO) as worker:
            start = time.perf_counter()
            run_id = start_deployment_run("peagle-pipeline/pipeline-demo",
                                          {"config_path": "configs/tiny.yaml", "overrides": shrunk_overrides(tmp)}, env)
            run = wait_for_flow_run(run_id, timeout_s=2400, worker=worker)
            print(f"\npipeline deployment run {run.name} ({run_id}): {run.state_name} "
                  f"after {time.perf_counter() - start:.0f} s")
            yield server, env, run, tmp, worker


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


def test_the_deployment_run_completes_with_named_stage_runs(deployed_run):
    server, _, run, tmp, _ = deployed_run
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


def test_every_stage_logs_into_the_run_including_training_steps(deployed_run):
    server, _, run, tmp, _ = deployed_run
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
    assert f"{PROMPTS - HELDOUT} train + {HELDOUT} held-out prompts" in text["data deployed (embedded)"]
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


def test_artifacts_and_the_registered_head(deployed_run):
    server, env, run, tmp, _ = deployed_run
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        artifacts = {a.key: a for a in client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["deployed-acceptance", "deployed-mlflow-run"])))}
    assert "| p-eagle | 2 | 1 |" in artifacts["deployed-acceptance"].data
    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    champion = client.get_model_version_by_alias("peagle-embedded", "champion")
    assert champion.run_id in artifacts["deployed-mlflow-run"].data
    files = {Path(f.path).name for f in client.list_artifacts(champion.run_id, "heads/peagle")}
    assert {"config.json", "model.safetensors"} <= files, files


def test_a_cli_run_afterwards_reuses_what_the_worker_cached(deployed_run):
    """`peagle run` with the same config, from another Prefect setting (its own ephemeral API):
    data, training and online evaluation come from the cache the worker's run left."""
    import subprocess
    import sys

    server, env, run, tmp, _ = deployed_run
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
