"""One Prefect flow per pipeline stage: data, train, evaluate, publish.

Each flow takes a config file (a YAML path plus overrides from a deployment, or the
resolved config the pipeline wrote into the run directory: ``peagle.config.write_resolved_config``)
and calls the stage functions of ``peagle.stages``. The pipeline and retraining flows
compose them as subflows; each also runs alone (``prefect.yaml``). Runs are named
"<stage> <config> (<target>)"; tasks by what they do ("train-peagle", "train-eagle3").
Stage tasks have time limits (``orchestration.timeouts_s``); data generation, training
and online evaluation each hold a slot of the accelerator concurrency limit.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flows.cache_keys import dataset_key, evaluation_key, training_key
from flows.common import (
    RESULT_SERIALIZER,
    RETRIES,
    RETRY_DELAY_S,
    acceptance_markdown,
    cache_key_from_param,
    ensure_accelerator_limit,
    on_accelerator,
    publish_acceptance_artifact,
    result_storage,
    retry_if_transient,
    run_logger,
    run_logs,
    run_namer,
)
from peagle import stages
from peagle.catalogue import describe
from peagle.config import PipelineConfig, load_config, write_resolved_config
from peagle.layout import BEST, RunLayout
from peagle.publish.gate import ChampionHead, champion_to_measure
from peagle.publish.promote import PublishOutcome, drafted, publish_once

CACHED = dict(cache_key_fn=cache_key_from_param, persist_result=True, result_serializer=RESULT_SERIALIZER)
TRANSIENT_RETRIES = dict(retries=RETRIES, retry_delay_seconds=RETRY_DELAY_S, retry_condition_fn=retry_if_transient)


def limits(cfg: PipelineConfig, stage: str, cached: bool = False) -> dict:
    """Task options of one run: the stage's time limit, and where cached results are stored."""
    options = {"timeout_seconds": getattr(cfg.orchestration.timeouts_s, stage)}
    if cached:
        options["result_storage"] = result_storage(cfg)
    return options


# ----------------------------------------------------------------------------- data


@task(name="resolve-target", cache_policy=NO_CACHE)
def target_task(cfg: PipelineConfig) -> stages.TargetInfo:
    return stages.prepare_target(cfg)


def resolve_target(cfg: PipelineConfig) -> stages.TargetInfo:
    """The target task under the run's time limit for it."""
    target = target_task.with_options(**limits(cfg, "target"))(cfg)
    run_logger().info("target %s: %s (revision %s: %s)", cfg.target.model, target.path, target.revision,
                      target.revision_source)
    return target


@task(name="generate-data", **CACHED, **TRANSIENT_RETRIES)
def data_task(cfg: PipelineConfig, target: stages.TargetInfo, key: str, force: bool = False):
    with on_accelerator(cfg):
        return stages.generate_data(cfg, target, force=force)


@task(name="write-requests", cache_policy=NO_CACHE)
def requests_task(cfg: PipelineConfig, target: stages.TargetInfo, force: bool = False) -> int:
    with on_accelerator(cfg):
        return stages.write_requests(cfg, target, force=force)


@task(name="data-part", task_run_name="data-part-{part}", cache_policy=NO_CACHE, **TRANSIENT_RETRIES)
def data_part_task(cfg: PipelineConfig, target: stages.TargetInfo, part: str, force: bool = False):
    with on_accelerator(cfg):
        return stages.generate_data_part(cfg, target, part, force=force)


@flow(name="peagle-data-part", flow_run_name=run_namer("data-part-{part}"))
def data_part_flow(config: str, part: str, overrides: dict | None = None, force: bool = False):
    """One host's part "I/N" of a data stage spread over hosts: its slice of the prompts
    regenerated and extracted beside the dataset, for the data flow to take in."""
    cfg = load_config(config, overrides)
    with run_logs(cfg):
        ensure_accelerator_limit(cfg)
        target = resolve_target(cfg)
        info = data_part_task.with_options(**limits(cfg, "data"))(cfg, target, part, force)
        get_run_logger().info("data part %s: %d of %d samples stored in %s", info.part, info.num_ok,
                              info.num_samples, info.part_dir)
        return info


@task(name="run-data-part", task_run_name="run-data-part-{part}", cache_policy=NO_CACHE)
def part_run_task(deployment: str, config: str, part: str, force: bool) -> str:
    """A flow run of the data-part deployment, on whichever worker of its pool takes it; waits
    for it to end."""
    from prefect.deployments import run_deployment

    run = run_deployment(deployment, parameters={"config": config, "part": part, "force": force}, timeout=None)
    if not run.state or not run.state.is_completed():
        raise RuntimeError(f"data part {part} (flow run {run.name}, {run.id}) ended {run.state.name if run.state else '?'}"
                           ": its log is in that flow run; rerun the data flow (finished parts are kept)")
    return str(run.id)


def check_workers_online(deployment: str, knob: str, unset: str, work: str) -> None:
    """``deployment`` exists on this server and a worker of its pool is online: else its runs
    would wait, scheduled, for a worker that never comes. ``knob`` starts its runs and ``unset``
    is the setting that starts none (both named in the fix); ``work``: what its runs do."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import WorkerStatus
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            pool = client.read_deployment_by_name(deployment).work_pool_name
        except ObjectNotFound:
            raise RuntimeError(f"{knob} starts runs of the deployment {deployment!r}, which this Prefect server does "
                               f"not have: deploy it (`peagle deploy`, or `prefect deploy --name "
                               f"{deployment.split('/')[1]}`), or set {unset}") from None
        online = [w for w in client.read_workers_for_work_pool(pool) if w.status == WorkerStatus.ONLINE]
    if not online:
        raise RuntimeError(f"no worker of the work pool {pool!r} (deployment {deployment}) is online to {work}: "
                           f"start one per host (`prefect worker start --pool {pool} --limit 1`)")


def build_parts(cfg: PipelineConfig, target: stages.TargetInfo, force: bool) -> None:
    """``orchestration.data_parts`` flow runs of the data-part deployment at once, each on a
    worker of its pool, after the Magpie requests every part reads are written here once."""
    from prefect.utilities.annotations import unmapped

    check_workers_online(cfg.orchestration.data_part_deployment, "orchestration.data_parts > 1",
                         "orchestration.data_parts: 1", "build the data parts")
    requests_task.with_options(**limits(cfg, "data"))(cfg, target, force)
    config = str(write_resolved_config(cfg))  # on the shared volume every worker reads PEAGLE_HOME from
    n = cfg.orchestration.data_parts
    parts = [f"{i}/{n}" for i in range(n)]
    # no time limit here: each part run's own data task has the stage's
    runs = part_run_task.map(unmapped(cfg.orchestration.data_part_deployment), unmapped(config), parts,
                             unmapped(force))
    runs.wait()
    failed = [part for part, run in zip(parts, runs, strict=True) if not run.state.is_completed()]
    if failed:
        raise RuntimeError(f"{len(failed)} of {n} data parts failed ({', '.join(failed)}): their flow runs say why; "
                           "rerun the data flow (finished parts are kept)")
    get_run_logger().info("data: %d parts built by %s", n, cfg.orchestration.data_part_deployment)


@flow(name="peagle-data", flow_run_name=run_namer("data"))
def data_flow(config: str, overrides: dict | None = None, force: bool = False,
              target: stages.TargetInfo | None = None):
    """Prompts -> regenerated responses -> hidden states; an unchanged dataset is reused from cache.
    With ``orchestration.data_parts`` N > 1 the work is spread over N part runs first."""
    cfg = load_config(config, overrides)
    with run_logs(cfg):
        ensure_accelerator_limit(cfg)
        target = target or resolve_target(cfg)
        refresh = force or not stages.dataset_on_disk(cfg)
        if refresh and cfg.orchestration.data_parts > 1:
            build_parts(cfg, target, force)
        info = data_task.with_options(refresh_cache=refresh, **limits(cfg, "data", cached=True))(
            cfg, target, dataset_key(cfg, target), force)
        get_run_logger().info("dataset %s: %d train + %d eval samples (%s)", info.data_dir, info.num_train,
                              info.num_eval, "built" if refresh else "cache key matched; reused if unchanged")
        return info


# ----------------------------------------------------------------------------- train


@dataclass
class TrainOutcome:
    checkpoint_dir: str
    best_checkpoint: str
    head_dir: str | None  # None when the caller exports (the pipeline does, in its own stage)
    metrics_history: list
    offline: object  # peagle.eval.offline result
    cache_key: str = ""  # the training key: what the exported head is a function of


@dataclass(frozen=True)
class ProducerRun:
    """What a flow run of ``orchestration.produce_deployment`` is started with: the training's own
    config, overrides, method and dataset, so it plans the same spool."""

    config: str
    overrides: dict | None
    method: str
    data_dir: str

    def parameters(self, training_task_run: str) -> dict:
        return {"config": self.config, "overrides": self.overrides, "method": self.method, "data_dir": self.data_dir,
                "training_task_run": training_task_run}


@task(name="train", task_run_name="train-{plan.method}", **CACHED)
def train_task(plan: stages.HeadPlan, target: stages.TargetInfo, key: str, mlflow_run_id: str | None = None,
               producer: ProducerRun | None = None):
    with on_accelerator(plan.config), producing_elsewhere(plan.config, producer):
        return stages.train_head(plan, target, mlflow_run_id=mlflow_run_id)


@contextlib.contextmanager
def producing_elsewhere(cfg: PipelineConfig, producer: ProducerRun | None):
    """With ``producer`` (data.producer: separate), a flow run of the produce deployment extracts
    for the training in this block (this task run's), on a worker of its pool: started before
    it, and waited for after a training that finished (it ends once the training writes its
    result). After a training that failed it stops by itself: it watches this task run."""
    if producer is None:
        yield
        return
    from prefect.deployments import run_deployment
    from prefect.runtime import task_run

    deployment = cfg.orchestration.produce_deployment
    run = run_deployment(deployment, parameters=producer.parameters(str(task_run.id)), timeout=0)  # once scheduled
    get_run_logger().info("data.producer: separate: flow run %s of %s extracts for this training", run.name, deployment)
    yield
    from prefect.flow_runs import FlowRunWaitTimeout, wait_for_flow_run
    from prefect.utilities.asyncutils import run_coro_as_sync

    try:
        ended = run_coro_as_sync(wait_for_flow_run(run.id, timeout=PRODUCER_END_WAIT_S)).state
    except FlowRunWaitTimeout:
        ended = None
    if ended is None or not ended.is_completed():
        get_run_logger().warning("the producer's flow run %s ended %s after the training finished: its log says why",
                                 run.name, ended.name if ended else f"no state in {PRODUCER_END_WAIT_S} s")


# A producer stops within seconds of the training's result (peagle.train.launch.produce_separately).
PRODUCER_END_WAIT_S = 300


def task_run_ended(task_run_id: str):
    """A check that the task run ``task_run_id`` has a final state (completed, failed, crashed...)."""
    from prefect.client.orchestration import get_client

    def ended() -> bool:
        with get_client(sync_client=True) as client:
            state = client.read_task_run(task_run_id).state
        return state is not None and state.is_final()

    return ended


def check_producer(cfg: PipelineConfig) -> None:
    """Before a training with a separate producer: the produce deployment has a worker online,
    and the accelerator limit has a slot for the producer beside the training's."""
    from prefect.client.orchestration import get_client

    orch = cfg.orchestration
    check_workers_online(orch.produce_deployment, "data.producer: separate", "data.producer: launcher",
                         "extract for the training")
    with get_client(sync_client=True) as client:
        slots = client.read_global_concurrency_limit_by_name(orch.accelerator_limit).limit
    if slots < 2:
        raise RuntimeError(f"data.producer: separate: the producer's flow run holds a slot of the global concurrency "
                           f"limit {orch.accelerator_limit!r} beside its training's, and it has {slots}: the producer "
                           f"would queue behind its own training. Give it a slot per run at once "
                           f"(`prefect gcl update {orch.accelerator_limit} --limit 2`)")


@task(name="evaluate-offline", task_run_name="evaluate-offline-{method}", cache_policy=NO_CACHE)
def offline_task(cfg: PipelineConfig, target: stages.TargetInfo, data_dir: str, checkpoint: str, method: str):
    return stages.evaluate_offline(cfg, target, Path(data_dir), Path(checkpoint), method=method)


@task(name="export", task_run_name="export-{method}", cache_policy=NO_CACHE)
def export_task(cfg: PipelineConfig, target: stages.TargetInfo, data_dir: str, checkpoint: str, method: str):
    return stages.export_head(cfg, target, Path(data_dir), Path(checkpoint), method=method)


def run_export(cfg: PipelineConfig, target: stages.TargetInfo, data_dir: str, checkpoint: str, method: str):
    """The export task under the run's time limit for it."""
    return export_task.with_options(**limits(cfg, "export"))(cfg, target, data_dir, checkpoint, method)


@flow(name="peagle-train", flow_run_name=run_namer("train-{method}"))
def train_flow(config: str, data_dir: str | None = None, overrides: dict | None = None,
               method: str | None = None, target: stages.TargetInfo | None = None, export: bool = True,
               mlflow_run_id: str | None = None) -> TrainOutcome:
    """DeepSpeed training (cached on the dataset's manifests and the training config), offline
    acceptance of the best checkpoint, and the exported head directory. With ``mlflow_run_id``
    (the pipeline's train stage run) each step's metrics reach that run while the ranks run."""
    cfg = load_config(config, overrides)
    with run_logs(cfg):
        ensure_accelerator_limit(cfg)
        cfg = stages.resolve_init_from(cfg)  # before the key: it names the champion
        method = describe(method or cfg.train.method).name
        data_dir = str(data_dir or RunLayout(cfg.run_dir).data.root)
        plan = stages.plan_head(cfg, method, Path(data_dir))  # the dataset checked before the target resolves
        target = target or resolve_target(cfg)
        ckpt_dir = plan.checkpoint_dir
        refresh = not (ckpt_dir / BEST).exists()
        key = training_key(plan)
        producer = None
        if cfg.data.producer == "separate":
            check_producer(cfg)
            producer = ProducerRun(config, overrides, method, data_dir)
        trained = train_task.with_options(refresh_cache=refresh, **limits(cfg, "train", cached=True))(
            plan, target, key, mlflow_run_id, producer)
        offline = offline_task.with_options(**limits(cfg, "evaluate"))(
            cfg, target, data_dir, str(trained.best_checkpoint), method)
        head_dir = run_export(cfg, target, data_dir, str(trained.best_checkpoint), method) if export else None
        return TrainOutcome(str(ckpt_dir), str(trained.best_checkpoint), head_dir and str(head_dir),
                            trained.metrics_history, offline, key)


@task(name="produce", task_run_name="produce-{plan.method}", cache_policy=NO_CACHE)
def produce_task(plan: stages.HeadPlan, target: stages.TargetInfo, training_task_run: str | None) -> bool:
    with on_accelerator(plan.config):
        return stages.produce_hidden_states(plan, target, training_task_run and task_run_ended(training_task_run))


@flow(name="peagle-produce", flow_run_name=run_namer("produce-{method}"))
def produce_flow(config: str, overrides: dict | None = None, method: str | None = None,
                 data_dir: str | None = None, training_task_run: str | None = None):
    """data.producer: separate: a streamed training's hidden states extracted on this worker's host
    (an inference node) into the head's spool, until that training ends. The train flow starts
    one (``orchestration.produce_deployment``) for each training it runs, with its own parameters
    and its task run (``training_task_run``): a training that fails leaves this run cancelled."""
    from prefect.states import Cancelled

    cfg = load_config(config, overrides)
    stages.require_separate_producer(cfg)
    with run_logs(cfg):
        ensure_accelerator_limit(cfg)
        method = describe(method or cfg.train.method).name
        plan = stages.plan_head(cfg, method, Path(data_dir or RunLayout(cfg.run_dir).data.root))
        if training_task_run and task_run_ended(training_task_run)():
            return Cancelled(message="its training ended before this producer started")
        target = resolve_target(cfg)
        # it lives as long as the training
        finished = produce_task.with_options(**limits(cfg, "train"))(plan, target, training_task_run)
        return None if finished else Cancelled(message="its training ended without a result")


# ----------------------------------------------------------------------------- evaluate


@task(name="evaluate-online", **CACHED, **TRANSIENT_RETRIES)
def online_task(cfg: PipelineConfig, target: stages.TargetInfo, heads: dict[str, str], key: str,
                champion: ChampionHead | None = None):
    """``heads``: method name -> head directory; ``champion``: the registry's, served beside them."""
    with on_accelerator(cfg):
        return stages.evaluate_online(cfg, target, {name: Path(d) for name, d in heads.items()}, champion)


@flow(name="peagle-evaluate", flow_run_name=run_namer("evaluate"))
def evaluate_flow(config: str, head_dir: str | None = None, overrides: dict | None = None,
                  target: stages.TargetInfo | None = None, head_key: str | None = None,
                  baseline_dir: str | None = None):
    """Acceptance per K and tokens/s in vLLM (cached on the heads' training keys, or their file
    hashes), with the registry's champion served in the same run (rows ``champion-v<N>``) so
    the gate compares like with like; publishes the acceptance table as a Prefect markdown artifact.

    ``head_dir``: the ``train.method`` head (default the run's ``heads/<method>``);
    ``baseline_dir``: the EAGLE-3 baseline trained on the same data, served alongside as its
    method drafts (default the run's ``heads/eagle3`` when ``train.baseline.eagle3``).
    Heads are keyed by method name; each is served as its method says (parallel or not).
    """
    cfg = load_config(config, overrides)
    heads = stages.heads_to_evaluate(cfg, head_dir, baseline_dir)
    with run_logs(cfg):
        ensure_accelerator_limit(cfg)
        target = target or resolve_target(cfg)
        head = heads[cfg.train.method]
        champion = champion_to_measure(cfg, head)
        if champion is not None:
            get_run_logger().info("measuring champion v%s beside the new head at K=%d, the K the gate compares "
                                  "(same prompts and engine settings)", champion.version, max(cfg.eval.ks))
        key = evaluation_key(cfg, target, heads, head_key, champion)
        online = online_task.with_options(**limits(cfg, "evaluate", cached=True))(cfg, target, heads, key, champion)
        get_run_logger().info("%s", acceptance_markdown(online))
        publish_acceptance_artifact(online, cfg.name)
        return online


# ----------------------------------------------------------------------------- publish


@task(name="register-and-gate", cache_policy=NO_CACHE, **TRANSIENT_RETRIES)
def publish_task(cfg: PipelineConfig, tracker, head_dir: str, online, validated: bool) -> PublishOutcome:
    return publish_once(cfg, tracker, Path(head_dir), online, validated=validated)


@flow(name="peagle-publish", flow_run_name=run_namer("publish"))
def publish_flow(config: str, head_dir: str | None = None, online_results: str | None = None,
                 overrides: dict | None = None, mlflow_run_id: str | None = None) -> PublishOutcome:
    """Register the head (alias challenger, its ``lineage.json`` as tags) and promote it through
    the registry gate (on the champion measured beside it in ``online_results``).

    ``head_dir`` / ``online_results``: by default the run directory's exported ``train.method`` head and
    the JSON the evaluate stage saved there (so a deployment names no machine-local path). With
    ``mlflow_run_id`` the head is registered under that (running) pipeline run; otherwise under
    a run of its own.
    """
    from peagle.eval.online import OnlineResult
    from peagle.tracking.mlflow_run import Tracker

    cfg = load_config(config, overrides)
    head_dir = str(head_dir or stages.exported_head_dir(cfg, cfg.train.method))
    online_results = str(online_results or RunLayout(cfg.run_dir).online_results)
    online = OnlineResult.load(online_results)
    validated = drafted(online, describe(cfg.train.method).label)
    publish = publish_task.with_options(**limits(cfg, "publish"))
    with run_logs(cfg):
        if mlflow_run_id:
            tracker = Tracker(cfg.tracking, target_id=cfg.target.model, run_id=mlflow_run_id).start()
            outcome = publish(cfg, tracker, head_dir, online, validated)
        else:
            with Tracker(cfg.tracking, target_id=cfg.target.model, config=cfg, run_name=f"{cfg.name}-publish") as tracker:
                outcome = publish(cfg, tracker, head_dir, online, validated)
        get_run_logger().info("registered %s version %s: %s", cfg.name, outcome.version, outcome.promotion.reason)
        return outcome
