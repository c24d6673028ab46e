"""prefect.yaml: Prefect's own model of the file accepts it, every deployment's parameters
fit its flow, and `peagle deploy` registers them (with their work pools) on a real server."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_prefect_yaml_validates_with_prefects_model():
    import yaml
    from prefect.cli.deploy._models import PrefectYamlModel

    model = PrefectYamlModel.model_validate(yaml.safe_load((REPO / "prefect.yaml").read_text()))
    names = {d.name for d in model.deployments}
    assert {"pipeline-demo", "data-demo", "train-demo", "evaluate-demo", "publish-demo", "retrain-demo"} <= names
    pools = {d.work_pool.name for d in model.deployments}
    assert pools == {"peagle-process", "peagle-docker", "peagle-k8s"}


def test_every_deployment_loads_its_flow_and_parameters():
    from flows.deploy import load_prefect_file

    specs = {s.name: s for s in load_prefect_file(REPO / "prefect.yaml")}
    assert specs["retrain-demo"].schedules[0].cron == "0 3 * * *"
    assert specs["retrain-qwen3-8b"].parameters["config_path"] == "configs/qwen3-8b.yaml"
    assert specs["retrain-llama-3.1-8b"].job_variables["gpu_count"] == 1
    for spec in specs.values():
        config = spec.parameters.get("config_path") or spec.parameters.get("config")
        assert (REPO / config).exists(), f"{spec.name}: {config} missing"


def test_a_bad_parameter_is_refused(tmp_path):
    from flows.deploy import load_prefect_file

    original = (REPO / "prefect.yaml").read_text()
    text = original.replace("warm_start: false}", "warm_start: false, epochs: 3}", 1)
    assert text != original  # the retrain-demo deployment's inline parameters got the bad key
    bad = tmp_path / "prefect.yaml"
    bad.write_text(text)
    with pytest.raises(Exception, match="epochs"):
        load_prefect_file(bad)


def test_kubernetes_pool_template_requests_gpus():
    from flows.deploy import kubernetes_gpu_template

    template = kubernetes_gpu_template()
    container = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpu_count }}"
    assert "gpu_count" in template["variables"]["properties"]


def test_deploy_registers_every_deployment_and_pool(prefect_server):
    from prefect.client.orchestration import get_client

    from flows.deploy import deploy

    ids = deploy(REPO / "prefect.yaml")
    with get_client(sync_client=True) as client:
        pools = {p.name: p.type for p in client.read_work_pools()}
        deployments = {d.name: d for d in client.read_deployments()}
    assert len(ids) == 8
    assert pools["peagle-process"] == "process" and pools["peagle-docker"] == "docker"
    assert pools["peagle-k8s"] == "kubernetes"
    retrain = deployments["retrain-demo"]
    assert retrain.schedules and retrain.schedules[0].schedule.cron == "0 3 * * *"
    assert retrain.parameters["config_path"] == "configs/demo.yaml"
    assert deployments["retrain-llama-3.1-8b"].job_variables["gpu_count"] == 1
    step = retrain.pull_steps[0]["prefect.deployments.steps.set_working_directory"]
    assert step["directory"] == "{{ $PEAGLE_REPO }}"
