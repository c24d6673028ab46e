"""prefect.yaml as users deploy it: the committed work-pool templates and `prefect deploy --all`
through Prefect's own CLI against a real `prefect server start` (the session's), read back through the API;
`peagle deploy` (the thin wrapper) and `peagle deploy --check` run as the `peagle` command."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.prefect_server import PREFECT, isolated_env
from tests.prefect_worker import deployed_on_this_server

REPO = Path(__file__).resolve().parents[2]
POOLS = {"peagle-process": "process", "peagle-docker": "docker", "peagle-k8s": "kubernetes"}
DEPLOYMENTS = {"pipeline-demo", "data-demo", "data-part", "produce", "train-demo", "evaluate-demo", "publish-demo",
               "retrain-demo", "retrain-qwen3-8b", "retrain-llama-3.1-8b"}


def peagle(*args, env=None, timeout=600) -> subprocess.CompletedProcess:
    """The `peagle` command of this checkout, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "peagle.cli", *args], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=timeout)


def prefect(*args, env, timeout=600) -> subprocess.CompletedProcess:
    result = subprocess.run([PREFECT, "--no-prompt", *args], cwd=REPO, env=env, text=True, capture_output=True,
                            timeout=timeout)
    assert result.returncode == 0, f"prefect {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
    return result


def doctored(tmp_path, edit) -> Path:
    """A copy of prefect.yaml with ``edit`` applied to its parsed form (anchors expanded)."""
    doc = yaml.safe_load((REPO / "prefect.yaml").read_text())
    edit({d["name"]: d for d in doc["deployments"]})
    path = tmp_path / "prefect.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


# ----------------------------------------------------------------------------- --check


@pytest.mark.slow
def test_check_passes_the_repos_file():
    result = peagle("deploy", "--check")
    assert result.returncode == 0, result.stdout + result.stderr
    for name in DEPLOYMENTS:
        assert f"ok {name}:" in result.stdout
    assert "retrain-llama-3.1-8b: requests 8 GPUs (peagle-k8s gpu_count)" in result.stdout
    assert "retrain-qwen3-8b: requests 8 GPUs (peagle-docker container_create_kwargs.device_requests)" in result.stdout


def test_check_refuses_gpus_that_do_not_cover_the_world_size(tmp_path):
    def too_few(d):
        d["retrain-llama-3.1-8b"]["work_pool"]["job_variables"]["gpu_count"] = 1
        d["retrain-qwen3-8b"]["work_pool"]["job_variables"]["container_create_kwargs"]["device_requests"][0]["count"] = 2

    result = peagle("deploy", "--check", "--prefect-file", str(doctored(tmp_path, too_few)))
    out = " ".join(result.stdout.split())  # rich may wrap long lines
    assert result.returncode == 1, out
    assert ("refused retrain-llama-3.1-8b: requests 1 GPU (peagle-k8s gpu_count) but its config starts "
            "train.launch.world_size 8 ranks") in out
    assert "fix: set `gpu_count: 8` in its work_pool.job_variables" in out
    assert "refused retrain-qwen3-8b: requests 2 GPUs" in out and "count: 8" in out
    assert "ok retrain-demo:" in out


def test_a_data_part_on_a_gpu_pool_needs_only_the_engines_gpus(tmp_path):
    """A data-part deployment never trains: one GPU covers one engine, whatever train.world_size."""
    def on_kubernetes(gpus: int):
        def edit(d):
            d["data-part"]["work_pool"] = {**d["retrain-llama-3.1-8b"]["work_pool"], "job_variables": {"gpu_count": gpus}}
            d["data-part"]["parameters"] = {"config": "configs/llama-3.1-8b-instruct.yaml", "part": "0/2",
                                            "overrides": {"vllm.data_parallel_size": 2}}
        return edit

    ok = peagle("deploy", "--check", "--name", "data-part", "--prefect-file",
                str(doctored(tmp_path, on_kubernetes(2))))
    out = " ".join(ok.stdout.split())
    assert ok.returncode == 0 and "ok data-part: requests 2 GPUs" in out and "covers 2" in out, out
    refused = peagle("deploy", "--check", "--name", "data-part", "--prefect-file",
                     str(doctored(tmp_path, on_kubernetes(1))))
    out = " ".join(refused.stdout.split())
    assert refused.returncode == 1, out
    assert "refused data-part: requests 1 GPU (peagle-k8s gpu_count) but its config starts vLLM tensor x data " \
           "parallel 2" in out and "lower vllm.data_parallel_size" in out, out


def test_check_refuses_a_parameter_the_flow_does_not_take(tmp_path):
    result = peagle("deploy", "--check", "--prefect-file",
                    str(doctored(tmp_path, lambda d: d["retrain-demo"]["parameters"].update(epochs=3))))
    assert result.returncode == 2
    assert "retrain-demo: parameters do not fit flows/retrain.py:retrain_flow" in result.stdout
    assert "epochs" in result.stdout


def test_deploy_refuses_without_a_prefect_api(tmp_path):
    """No PREFECT_API_URL: Prefect would deploy to a temporary server that vanishes; say so and stop."""
    result = peagle("deploy", "--name", "retrain-demo", env=isolated_env(tmp_path))
    assert result.returncode == 2
    assert "no Prefect API configured" in result.stdout and "PREFECT_API_URL" in result.stdout


def test_kubernetes_and_docker_templates_request_gpus_through_job_variables():
    k8s = json.loads((REPO / "deploy/work-pools/kubernetes/peagle-k8s.json").read_text())
    container = k8s["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpu_count }}"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "{{ gpu_count }}"
    assert container["args"] == "{{ command }}"  # the worker's command is the container's whole command
    assert k8s["variables"]["properties"]["gpu_count"]["type"] == "integer"
    docker = json.loads((REPO / "deploy/work-pools/docker/peagle-docker.json").read_text())
    assert docker["job_configuration"]["container_create_kwargs"] == "{{ container_create_kwargs }}"
    assert docker["variables"]["properties"]["container_create_kwargs"]["type"] == "object"


# ----------------------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def server(prefect_server):
    """The session's server; the file's work pools and deployment names are this module's until it ends."""
    with deployed_on_this_server(set(POOLS), DEPLOYMENTS):
        yield prefect_server


def read_back(server) -> tuple[dict, dict]:
    """The file's work pools and the deployments in them, as the server holds them (Prefect's client, the API)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import WorkPoolFilter, WorkPoolFilterName

    in_the_files_pools = WorkPoolFilter(name=WorkPoolFilterName(any_=sorted(POOLS)))
    with get_client(sync_client=True) as client:
        pools = {p.name: p for p in client.read_work_pools(work_pool_filter=in_the_files_pools)}
        deployments = {d.name: d for d in client.read_deployments(work_pool_filter=in_the_files_pools)}
    return pools, deployments


@pytest.mark.slow  # a real server and Prefect's CLI in subprocesses: 30-75 s on 2 cores
def test_prefect_deploy_all_registers_the_file(server):
    """The documented commands: `prefect work-pool create` per committed template, `prefect deploy --all`."""
    from flows.deploy import work_pool_templates

    templates = work_pool_templates()
    assert {name: t.type for name, t in templates.items()} == POOLS
    for template in templates.values():
        prefect(*template.create_command(), env=server.env)
    prefect("deploy", "--all", env=server.env)

    pools, deployments = read_back(server)
    for name, template in templates.items():
        assert pools[name].type == POOLS[name]
        assert pools[name].base_job_template == json.loads(template.path.read_text())
    assert set(deployments) == DEPLOYMENTS
    pipeline = deployments["pipeline-demo"]
    assert pipeline.entrypoint == "flows/pipeline.py:pipeline_flow" and pipeline.work_pool_name == "peagle-process"
    assert pipeline.parameters == {"config_path": "configs/demo.yaml", "overrides": {}}
    step = pipeline.pull_steps[0]["prefect.deployments.steps.set_working_directory"]
    assert step["directory"] == "{{ $PEAGLE_REPO }}"  # resolved by the worker, where the code is
    assert deployments["publish-demo"].parameters == {"config": "configs/demo.yaml"}
    part = deployments["data-part"]  # what the data flow starts once per part (orchestration.data_parts)
    assert part.entrypoint == "flows/stages.py:data_part_flow" and part.work_pool_name == "peagle-process"
    produce = deployments["produce"]  # what the train flow starts per training (data.producer: separate)
    assert produce.entrypoint == "flows/stages.py:produce_flow" and produce.work_pool_name == "peagle-process"

    retrain = deployments["retrain-demo"]
    assert [(s.schedule.cron, s.schedule.timezone, s.active) for s in retrain.schedules] == [("0 3 * * *", "UTC", True)]
    assert retrain.parameters == {"config_path": "configs/demo.yaml", "overrides": {}, "force": False,
                                  "warm_start": False}
    for name in ("retrain-demo", "retrain-qwen3-8b", "retrain-llama-3.1-8b"):  # one retraining at a time
        assert deployments[name].global_concurrency_limit.limit == 1
        assert deployments[name].concurrency_options.collision_strategy == "CANCEL_NEW"
    llama = deployments["retrain-llama-3.1-8b"]
    assert llama.work_pool_name == "peagle-k8s" and llama.work_queue_name == "gpu"
    assert llama.job_variables["gpu_count"] == 8 and llama.job_variables["namespace"] == "peagle"
    assert llama.schedules[0].schedule.cron == "0 4 * * 0"
    qwen = deployments["retrain-qwen3-8b"]
    assert qwen.work_pool_name == "peagle-docker"
    assert qwen.job_variables["container_create_kwargs"]["device_requests"] == [
        {"driver": "nvidia", "count": 8, "capabilities": [["gpu"]]}]


@pytest.mark.slow  # a real server and Prefect's CLI in subprocesses: 30-75 s on 2 cores
def test_peagle_deploy_creates_a_missing_pool_and_keeps_every_schedule_kind(server, tmp_path):
    """`peagle deploy` = the check, `prefect work-pool create` for missing pools, `prefect deploy`."""
    def every_schedule_kind(d):
        d["retrain-demo"]["schedules"] += [
            {"interval": 3600, "anchor_date": "2026-01-01T00:00:00Z", "timezone": "UTC"},
            {"rrule": "FREQ=WEEKLY;BYDAY=MO,WE;BYHOUR=2", "timezone": "UTC", "active": False},
        ]

    if "peagle-k8s" in read_back(server)[0]:  # the test above created it
        prefect("work-pool", "delete", "peagle-k8s", env=server.env)
    path = doctored(tmp_path, every_schedule_kind)
    result = peagle("deploy", "--prefect-file", str(path), env=server.env)
    assert result.returncode == 0, result.stdout + result.stderr
    created = " ".join(result.stdout.split()).split("work pools created: ")[1]
    assert "peagle-k8s" in created

    pools, deployments = read_back(server)
    assert pools["peagle-k8s"].type == "kubernetes" and set(deployments) == DEPLOYMENTS
    assert deployments["retrain-llama-3.1-8b"].work_pool_name == "peagle-k8s"
    schedules = [(s.schedule, s.active) for s in deployments["retrain-demo"].schedules]
    kinds = {type(s).__name__: (s, active) for s, active in schedules}
    assert set(kinds) == {"CronSchedule", "IntervalSchedule", "RRuleSchedule"}
    assert kinds["CronSchedule"][0].cron == "0 3 * * *"
    assert kinds["IntervalSchedule"][0].interval.total_seconds() == 3600
    assert "BYDAY=MO,WE" in kinds["RRuleSchedule"][0].rrule and kinds["RRuleSchedule"][1] is False
