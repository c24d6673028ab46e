"""``peagle deploy``: Prefect's own CLI, plus the one check Prefect cannot make.

``prefect deploy --all`` registers ``prefect.yaml``'s deployments but needs their work pools to
exist, so :func:`deploy` first creates the missing ones with ``prefect work-pool create NAME
--type TYPE --base-job-template deploy/work-pools/TYPE/NAME.json`` (the committed templates),
then runs ``prefect --no-prompt deploy`` itself: schedules, parameters, pull steps and job
variables reach the server exactly as Prefect reads them.

:func:`check_deployments` (``peagle deploy --check``) loads each deployment's flow, its
parameters and its pipeline config, and refuses a deployment whose GPUs, requested through its
pool's job variables, do not cover the ranks its config starts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from flows import require_prefect_api
from peagle.config import load_config
from peagle.paths import REPO_ROOT

PREFECT_FILE = REPO_ROOT / "prefect.yaml"
WORK_POOLS_DIR = REPO_ROOT / "deploy" / "work-pools"
GPU_POOL_TYPES = ("docker", "kubernetes")  # the pool types whose job variables request GPUs


class DeployError(ValueError):
    """A deployment that cannot be deployed as written; the message names it and the fix."""


# ----------------------------------------------------------------------------- work pools


@dataclass(frozen=True)
class WorkPoolTemplate:
    """A committed base job template: ``deploy/work-pools/<type>/<pool name>.json``."""

    name: str
    type: str
    path: Path

    def defaults(self) -> dict:
        """The job variables' defaults (what a deployment gets for a variable it does not set)."""
        properties = json.loads(self.path.read_text())["variables"]["properties"]
        return {key: spec["default"] for key, spec in properties.items() if "default" in spec}

    def create_command(self) -> list[str]:
        return ["work-pool", "create", self.name, "--type", self.type, "--base-job-template", str(self.path)]


def work_pool_templates(root: Path = WORK_POOLS_DIR) -> dict[str, WorkPoolTemplate]:
    return {p.stem: WorkPoolTemplate(p.stem, p.parent.name, p) for p in sorted(Path(root).glob("*/*.json"))}


# ----------------------------------------------------------------------------- prefect.yaml


@dataclass(frozen=True)
class Deployment:
    """What the check needs of one ``prefect.yaml`` deployment (anchors already resolved)."""

    name: str
    entrypoint: str
    parameters: dict
    pool: str
    job_variables: dict


def read_deployments(path: Path = PREFECT_FILE, names: list[str] | None = None) -> list[Deployment]:
    """The deployments of ``path`` (all, or those in ``names``), each with a name, entrypoint and pool."""
    path = Path(path)
    if not path.exists():
        raise DeployError(f"{path}: no such file; pass the deployments file with --prefect-file")
    doc = yaml.safe_load(path.read_text()) or {}
    deployments = []
    for i, d in enumerate(doc.get("deployments") or []):
        pool = d.get("work_pool") or {}
        if not d.get("name") or not d.get("entrypoint") or not pool.get("name"):
            raise DeployError(f"{path}: deployment #{i + 1} ({d.get('name')!r}) needs a name, an entrypoint "
                              "and a work_pool name")
        deployments.append(Deployment(d["name"], d["entrypoint"], dict(d.get("parameters") or {}), pool["name"],
                                      dict(pool.get("job_variables") or {})))
    if names:
        unknown = sorted(set(names) - {d.name for d in deployments})
        if unknown:
            raise DeployError(f"{path}: no deployment named {unknown}; it has {[d.name for d in deployments]}")
        deployments = [d for d in deployments if d.name in names]
    return deployments


# ----------------------------------------------------------------------------- the check


@dataclass(frozen=True)
class GpuCheck:
    deployment: str
    ok: bool
    message: str


def requested_gpus(pool_type: str, job_variables: dict) -> int | None:
    """GPUs a flow run gets from its job variables; None where the pool does not say.

    kubernetes: ``gpu_count`` (nvidia.com/gpu of the pod, deploy/work-pools/kubernetes/);
    docker: ``container_create_kwargs.device_requests`` (docker-py), None for ``count: -1``
    (every GPU of the host); process: None (the worker host's devices).
    """
    if pool_type == "kubernetes":
        return int(job_variables.get("gpu_count") or 0)
    if pool_type != "docker":
        return None
    total = 0
    for request in (job_variables.get("container_create_kwargs") or {}).get("device_requests") or []:
        capabilities = {c for group in request.get("capabilities") or [] for c in group}
        if request.get("driver") != "nvidia" and "gpu" not in capabilities:
            continue
        if request.get("device_ids"):
            total += len(request["device_ids"])
        elif int(request.get("count", 0)) == -1:
            return None
        else:
            total += int(request.get("count", 0))
    return total


GPU_VARIABLE = {"kubernetes": "gpu_count", "docker": "container_create_kwargs.device_requests"}
GPU_FIX = {
    "kubernetes": "set `gpu_count: {n}` in its work_pool.job_variables",
    "docker": "set `container_create_kwargs: {{device_requests: [{{driver: nvidia, count: {n}, "
              "capabilities: [[gpu]]}}]}}` in its work_pool.job_variables",
}


def deployment_config(d: Deployment):
    """The pipeline config the deployment's run loads (its config path plus overrides), or None."""
    path = d.parameters.get("config_path") or d.parameters.get("config")
    if not isinstance(path, str):
        return None
    return load_config(REPO_ROOT / path if not Path(path).is_absolute() else path, d.parameters.get("overrides"))


# Flows that run data engines and never train (data stage, its parts, a separate producer): their
# GPUs need only cover vLLM's.
DATA_ONLY_FLOWS = {"flows/stages.py:data_flow", "flows/stages.py:data_part_flow", "flows/stages.py:produce_flow"}


def check_gpus(d: Deployment, pool: WorkPoolTemplate, cfg) -> GpuCheck:
    """Do the GPUs ``d`` asks its pool for cover the ranks (and vLLM replicas) its config starts?"""
    dp = cfg.vllm.data_parallel_size
    vllm_gpus = cfg.vllm.tensor_parallel_size * (1 if dp == "auto" else dp)  # auto: one engine, more where given
    engines = f"vLLM tensor x data parallel {vllm_gpus}" + (" (data parallel auto: at least one engine)"
                                                             if dp == "auto" else "")
    if d.entrypoint in DATA_ONLY_FLOWS:
        needed, starts, needs = vllm_gpus, engines, engines
    else:
        ranks = cfg.train.launch.ranks_per_node  # a multi-node run's deployment runs on every node: one node's share
        needed = max(ranks, vllm_gpus)
        spread = f" over train.launch.nodes {cfg.train.launch.nodes}" if cfg.train.launch.nodes > 1 else ""
        starts = (f"train.launch.world_size {cfg.train.launch.world_size}{spread}: {ranks} ranks per node" if spread
                  else f"train.launch.world_size {cfg.train.launch.world_size} ranks")
        needs = f"train.launch.world_size {cfg.train.launch.world_size}{spread}, {engines}"
    requested = requested_gpus(pool.type, {**pool.defaults(), **d.job_variables})
    if requested is None:
        where = "the worker host's devices" if pool.type == "process" else "every GPU of the host (count -1)"
        return GpuCheck(d.name, True, f"{d.name}: {pool.name} ({pool.type}) gives it {where}; not compared "
                                      f"with {needs}")
    if requested >= needed:
        return GpuCheck(d.name, True, f"{d.name}: requests {requested} GPUs ({pool.name} {GPU_VARIABLE[pool.type]}), "
                                      f"covers {needed} ({needs})")
    fix = GPU_FIX[pool.type].format(n=needed)
    return GpuCheck(d.name, False,
                    f"{d.name}: requests {requested} GPU{'s' if requested != 1 else ''} ({pool.name} "
                    f"{GPU_VARIABLE[pool.type]}) but its config starts {starts} "
                    f"(needs {needed} GPUs: {needs}); fix: {fix}, or lower "
                    f"{'vllm.data_parallel_size' if d.entrypoint in DATA_ONLY_FLOWS else 'train.launch.world_size'} in its "
                    "`overrides`")


def check_deployments(path: Path = PREFECT_FILE, names: list[str] | None = None,
                      pools_dir: Path = WORK_POOLS_DIR) -> list[GpuCheck]:
    """Each deployment's flow loads, its parameters fit the flow, its pool has a committed template,
    its config loads, and its requested GPUs cover that config (one result per deployment)."""
    from prefect.flows import load_flow_from_entrypoint

    pools = work_pool_templates(pools_dir)
    results = []
    for d in read_deployments(path, names):
        if d.pool not in pools:
            raise DeployError(f"{d.name}: work pool {d.pool!r} has no base job template in {pools_dir} "
                              f"(add {pools_dir}/<type>/{d.pool}.json, from `prefect work-pool "
                              "get-default-base-job-template --type <type>`)")
        flow = load_flow_from_entrypoint(str(REPO_ROOT / d.entrypoint))
        try:
            flow.validate_parameters(d.parameters)
        except Exception as err:
            raise DeployError(f"{d.name}: parameters do not fit {d.entrypoint}: {err}") from None
        cfg = deployment_config(d)
        if cfg is None:
            results.append(GpuCheck(d.name, True, f"{d.name}: no pipeline config parameter; nothing to compare"))
        else:
            results.append(check_gpus(d, pools[d.pool], cfg))
    return results


# ----------------------------------------------------------------------------- deploying


def prefect_cli(*args: str, capture: bool = False) -> subprocess.CompletedProcess:
    """Run Prefect's CLI (the one installed beside this Python) non-interactively in the checkout."""
    exe = Path(sys.executable).with_name("prefect")
    command = [str(exe) if exe.exists() else (shutil.which("prefect") or "prefect"), "--no-prompt", *args]
    return subprocess.run(command, cwd=REPO_ROOT, env=os.environ.copy(), text=True,
                          capture_output=capture, check=False)


def require_api_url() -> str:
    """The Prefect API deployments go to; refuse Prefect's throw-away ephemeral server."""
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    if not url:
        raise DeployError("no Prefect API configured: deployments would go to a temporary server that stops with "
                          "this command; start one (`prefect server start`) and point at it with `prefect config "
                          "set PREFECT_API_URL=http://127.0.0.1:4200/api` (or `prefect cloud login`)")
    return url


def existing_work_pools() -> set[str]:
    result = prefect_cli("work-pool", "ls", "--output", "json", capture=True)
    if result.returncode != 0:
        lines = (result.stdout + result.stderr).strip().splitlines()
        raise DeployError(f"`prefect work-pool ls` failed: {lines[-1] if lines else f'exit {result.returncode}'}")
    return {pool["name"] for pool in json.loads(result.stdout[result.stdout.index("["):])}


def ensure_work_pools(names: set[str], pools_dir: Path = WORK_POOLS_DIR) -> list[str]:
    """``prefect work-pool create`` each named pool that does not exist yet; returns those created.

    An existing pool is left as it is (its template may have been customised on the server).
    """
    templates = work_pool_templates(pools_dir)
    missing = sorted(names - existing_work_pools())
    for name in missing:
        result = prefect_cli(*templates[name].create_command())
        if result.returncode != 0:
            raise DeployError(f"`prefect {' '.join(templates[name].create_command())}` failed")
    return missing


def deploy(path: Path = PREFECT_FILE, names: list[str] | None = None) -> list[str]:
    """Create the missing work pools, then ``prefect deploy`` the file (all, or ``names``).

    Run :func:`check_deployments` first. Returns the work pools created.
    """
    require_api_url()
    require_prefect_api()  # a server that does not answer: one line saying so, not Prefect's traceback
    deployments = read_deployments(path, names)
    created = ensure_work_pools({d.pool for d in deployments})
    selection = [arg for d in deployments for arg in ("--name", d.name)] if names else ["--all"]
    result = prefect_cli("deploy", *selection, "--prefect-file", str(Path(path).resolve()))
    if result.returncode != 0:
        raise DeployError(f"`prefect deploy` failed for {path} (its output is above)")
    return created
