"""A real ``prefect worker start`` and Prefect's CLI, for tests that run deployments as users do.

    server = prefect_server                                    # the session's one server (tests/conftest.py)
    env = {**server.env, "PEAGLE_REPO": str(REPO)}
    with deployed_on_this_server(pools={"peagle-process"}, deployments={"pipeline-demo"}):
        prefect_cli(["work-pool", "create", "peagle-process", "--type", "process"], env)
        prefect_cli(["--no-prompt", "deploy", "--name", "pipeline-demo"], env, cwd=REPO)
        with prefect_worker("peagle-process", env, tmp / "worker.log"):
            run_id = start_deployment_run("peagle-pipeline/pipeline-demo", {...}, env)
            state = wait_for_flow_run(run_id, timeout_s=1800)

The worker runs each flow run in a subprocess of its own (a process pool), exactly as a
user's worker does; it is stopped (its process group killed) on exit. Work-pool and
deployment names are global on a Prefect server, and prefect.yaml fixes them: a test module
that deploys owns its names while it runs and removes them when it ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time
from pathlib import Path

from tests.prefect_server import PREFECT
from tests.processes import log_tail, process_group

UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def worker_env(server, tmp: Path) -> dict:
    """What a process worker of prefect.yaml's deployments runs with: the session's server, the
    checkout its pull step finds, MLflow's URI from the environment (never a parameter), offline
    libraries, and a short poll so a test's runs start soon."""
    repo = Path(__file__).resolve().parent.parent
    return {**server.env,
            "PEAGLE_REPO": str(repo),  # prefect.yaml's pull step: where the worker finds the code
            "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])),
            "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}",  # from the environment, never a parameter
            "PREFECT_LOGGING_LEVEL": "INFO",
            "PREFECT_WORKER_QUERY_SECONDS": "3",
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def prefect_cli(args: list[str], env: dict, cwd: Path | None = None, timeout_s: float = 300) -> str:
    """Run ``prefect ARGS`` as a user would; returns its output, raises with it on failure."""
    proc = subprocess.run([PREFECT, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"prefect {' '.join(args)} exited with {proc.returncode}:\n{output[-4000:]}")
    return output


def start_deployment_run(deployment: str, parameters: dict, env: dict) -> str:
    """``prefect deployment run NAME --params JSON``; returns the new flow run's id."""
    output = prefect_cli(["deployment", "run", deployment, "--params", json.dumps(parameters)], env)
    match = UUID_RE.search(output)
    if match is None:
        raise RuntimeError(f"no flow run id in the output of `prefect deployment run`:\n{output}")
    return match.group(0)


@contextlib.contextmanager
def prefect_worker(pool: str, env: dict, log: Path, cwd: Path | None = None, args: tuple[str, ...] = ()):
    """``prefect worker start --pool POOL [ARGS]`` until the block ends; yields the process."""
    with process_group([PREFECT, "worker", "start", "--pool", pool, *args], log, env=env, cwd=cwd,
                       stop_timeout_s=30) as proc:
        time.sleep(1)
        if proc.poll() is not None:
            raise RuntimeError(f"prefect worker exited with {proc.returncode}:\n{log_tail(log)}")
        yield proc


def wait_for_flow_run(flow_run_id, timeout_s: float, poll_s: float = 5.0, worker: subprocess.Popen | None = None):
    """Poll the API (this process's Prefect settings) until the flow run is final; returns it."""
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            run = client.read_flow_run(flow_run_id)
            if run.state is not None and run.state.is_final():
                return run
            if worker is not None and worker.poll() is not None:
                raise RuntimeError(f"the worker exited ({worker.returncode}) while {flow_run_id} was {run.state_name}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"flow run {flow_run_id} still {run.state_name} after {timeout_s:.0f} s")
            time.sleep(poll_s)


def wait_for_online_workers(pool: str, count: int, timeout_s: float = 90.0) -> None:
    """Until ``count`` workers of ``pool`` have sent the server their first heartbeat (online)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import WorkerStatus

    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            online = [w.name for w in client.read_workers_for_work_pool(pool) if w.status == WorkerStatus.ONLINE]
            if len(online) >= count:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(online)} of {count} workers of {pool} online after {timeout_s:.0f} s: {online}")
            time.sleep(1)


def read_all_logs(client, flow_run_ids: list) -> list:
    """Every log record of these flow runs (and their task runs), oldest first, page by page."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    logs, page = [], 200
    while True:
        batch = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=flow_run_ids)),
                                 limit=page, offset=len(logs), sort=LogSort.TIMESTAMP_ASC)
        logs += batch
        if len(batch) < page:
            return logs


def logs_of_finished_runs(client, flow_run_ids: list, wait_s: float = 120) -> list:
    """Every log record of these finished flow runs once each run's last line ("Finished in
    state ...", Prefect's own) is stored: a run's process ships its log batches in the
    background, so they can reach the API after its final state does (the UI lags the same).
    The flow run's own line, not a task's: a task run's records carry its flow run's id too,
    and its "Finished in state" can be stored before the flow logs what it decided next. Read
    them before stopping the worker that ran them: its run's process may still be shipping them."""
    deadline = time.monotonic() + wait_s
    while True:
        logs = read_all_logs(client, flow_run_ids)
        finished = {r.flow_run_id for r in logs
                    if r.task_run_id is None and r.message.startswith("Finished in state")}
        if finished >= set(flow_run_ids):
            return logs
        if time.monotonic() > deadline:
            raise TimeoutError(f"flow run(s) {sorted(map(str, set(flow_run_ids) - finished))} stored no "
                               f"'Finished in state' line within {wait_s:.0f} s: was the process that ran them "
                               "(a worker's) stopped before it shipped its last log lines?")
        time.sleep(2)


@contextlib.contextmanager
def deployed_on_this_server(pools: set[str], deployments: set[str]):
    """Own these work-pool and deployment names on the server this process talks to (the
    session's): they must not exist yet (another module left them otherwise), and they are
    deleted when the block ends, deployments first (their scheduled runs go with them)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        taken = existing(client, pools, deployments)
    if taken:
        raise RuntimeError(f"{', '.join(taken)} already on the session's Prefect server: the test module that "
                           "created them must remove them (wrap it in tests/prefect_worker.py:deployed_on_this_server)")
    try:
        yield
    finally:
        with get_client(sync_client=True) as client:
            remove(client, pools, deployments)


def existing(client, pools: set[str], deployments: set[str]) -> list[str]:
    """The names among ``pools`` and ``deployments`` the server holds ("pool X", "deployment Y")."""
    return sorted([f"work pool {p.name}" for p in client.read_work_pools() if p.name in pools]
                  + [f"deployment {d.name}" for d in read_deployments_named(client, deployments)])


def read_deployments_named(client, names: set[str]) -> list:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    return client.read_deployments(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=sorted(names))))


def remove(client, pools: set[str], deployments: set[str]) -> None:
    from prefect.exceptions import ObjectNotFound

    for deployment in read_deployments_named(client, deployments):
        client.delete_deployment(deployment.id)
    for pool in pools:
        with contextlib.suppress(ObjectNotFound):
            client.delete_work_pool(pool)
