"""Register the deployments of ``prefect.yaml`` (what ``peagle deploy`` runs).

The file is validated with Prefect's own model of ``prefect.yaml`` (the one ``prefect
deploy`` uses), every deployment's parameters are validated against its flow's signature,
the work pools it names are created when missing (process, docker, and kubernetes with a
``gpu_count`` variable that requests ``nvidia.com/gpu``), then each deployment is applied
to the Prefect API in ``PREFECT_API_URL`` (or the local server).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from peagle.paths import REPO_ROOT

PREFECT_FILE = REPO_ROOT / "prefect.yaml"
POOL_TYPES = {"peagle-process": "process", "peagle-docker": "docker", "peagle-k8s": "kubernetes"}


@dataclass
class DeploymentSpec:
    name: str
    flow: object  # the prefect Flow the entrypoint names
    entrypoint: str
    parameters: dict
    schedules: list
    work_pool: str
    work_queue: str | None
    job_variables: dict
    tags: list[str]
    description: str | None
    pull_steps: list[dict]  # where a worker finds the code: the repo checkout, or /opt/peagle in the images


def load_prefect_file(path: Path = PREFECT_FILE) -> list[DeploymentSpec]:
    """Every deployment of ``path``, validated (file schema, entrypoint, parameters, cron)."""
    from prefect.cli.deploy._models import PrefectYamlModel
    from prefect.flows import load_flow_from_entrypoint
    from prefect.schedules import Cron

    model = PrefectYamlModel.model_validate(yaml.safe_load(Path(path).read_text()))
    specs = []
    for d in model.deployments:
        if not d.entrypoint or not d.work_pool or not d.work_pool.name:
            raise ValueError(f"{path}: deployment {d.name!r} needs an entrypoint and a work_pool name")
        flow = load_flow_from_entrypoint(str(REPO_ROOT / d.entrypoint))
        parameters = d.parameters or {}
        flow.validate_parameters(parameters)  # raises naming the bad parameter
        schedules = [Cron(s.cron, timezone=s.timezone or "UTC", active=s.active if s.active is not None else True)
                     for s in (d.schedules or []) if getattr(s, "cron", None)]
        specs.append(DeploymentSpec(d.name, flow, d.entrypoint, parameters, schedules, d.work_pool.name,
                                    d.work_pool.work_queue_name, dict(d.work_pool.job_variables or {}),
                                    list(d.tags or []), d.description, list(d.pull or model.pull or [])))
    return specs


def default_base_job_template(pool_type: str) -> dict:
    """The default job template Prefect ships for a worker type (no network needed)."""
    import prefect.server.api.collections_data as data

    path = Path(list(data.__path__)[0]) / "views" / "aggregate-worker-metadata.json"
    for workers in json.loads(path.read_text()).values():
        if pool_type in workers:
            return copy.deepcopy(workers[pool_type]["default_base_job_configuration"])
    return {}


def kubernetes_gpu_template() -> dict:
    """Prefect's Kubernetes job template plus a ``gpu_count`` variable requesting ``nvidia.com/gpu``."""
    template = default_base_job_template("kubernetes")
    template["variables"]["properties"]["gpu_count"] = {
        "title": "GPUs", "type": "integer", "default": 1,
        "description": "nvidia.com/gpu requested (and limited) per flow-run pod",
    }
    container = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    container["resources"]["limits"]["nvidia.com/gpu"] = "{{ gpu_count }}"
    container["resources"]["requests"]["nvidia.com/gpu"] = "{{ gpu_count }}"
    return template


def pool_template(pool_type: str) -> dict:
    return kubernetes_gpu_template() if pool_type == "kubernetes" else default_base_job_template(pool_type)


def ensure_work_pools(names: set[str]) -> list[str]:
    """Create the named work pools that do not exist yet; returns the ones created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    created = []
    with get_client(sync_client=True) as client:
        for name in sorted(names):
            try:
                client.read_work_pool(name)
                continue
            except ObjectNotFound:
                pass
            pool_type = POOL_TYPES.get(name, "process")
            client.create_work_pool(WorkPoolCreate(name=name, type=pool_type, base_job_template=pool_template(pool_type)))
            created.append(name)
    return created


def deploy(path: Path = PREFECT_FILE, names: list[str] | None = None) -> list[str]:
    """Validate ``path`` and apply its deployments (all, or those in ``names``); returns their ids."""
    specs = load_prefect_file(path)
    if names:
        unknown = set(names) - {s.name for s in specs}
        if unknown:
            raise ValueError(f"no deployment named {sorted(unknown)} in {path}; it has {[s.name for s in specs]}")
        specs = [s for s in specs if s.name in names]
    ensure_work_pools({s.work_pool for s in specs})
    ids = []
    for s in specs:
        deployment = s.flow.to_deployment(
            name=s.name, parameters=s.parameters, schedules=s.schedules, work_pool_name=s.work_pool,
            work_queue_name=s.work_queue, job_variables=s.job_variables, tags=s.tags, description=s.description,
        )
        deployment_id = deployment.apply()
        set_pull_steps(deployment_id, s.pull_steps)
        ids.append(str(deployment_id))
    return ids


def set_pull_steps(deployment_id, pull_steps: list[dict]) -> None:
    """The file's pull steps replace the registering machine's path, which a container lacks."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentUpdate

    if pull_steps:
        with get_client(sync_client=True) as client:
            client.update_deployment(deployment_id, DeploymentUpdate(pull_steps=pull_steps))
