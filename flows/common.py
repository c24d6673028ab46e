"""What every peagle flow shares: parameters, run names, logs, the accelerator limit,
retry rules, cache keys and Prefect artifacts.

Caching: a cached task's key is computed by a named function of ``flows.cache_keys``
(``dataset_key``, ``training_key``, ``evaluation_key``) from the inputs that decide its
output (config section hashes, prompt-file hashes, target revision, dataset manifests,
head file hashes), never from machine-local paths. Results are stored as JSON
(no pickle) in the run directory itself (``result_storage``), so the CLI and a worker
that share the run directory share the cache, whatever their Prefect settings. A key is
only trusted while the files it points to still exist: the caller passes
``refresh_cache`` when they do not.

Parameters: Prefect stores every flow run's parameters. Stage flows take a config file
path and overrides, never a config object: the pipeline writes the resolved config into
the run directory (``peagle.config.write_resolved_config``) and passes its path, so no
tracking URI or other secret a config may hold is stored by Prefect.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from peagle.config import PipelineConfig, load_config
from peagle.logs import ROOT, run_library_output
from peagle.serving.engine import EngineStartError

RESULT_SERIALIZER = "json"
RETRIES = 2
RETRY_DELAY_S = 15
RESULTS_DIR = "prefect-results"  # cached task results, inside the run directory

# ----------------------------------------------------------------------------- run names


def target_label(model: str) -> str:
    """A hub id's model name or a local directory's name ("Llama-3.1-8B-Instruct", "embedded")."""
    return Path(model.rstrip("/")).name or model


def run_namer(what: str, config_param: str = "config"):
    """A ``flow_run_name`` callable: "<what> <config name> (<target>)", e.g. "train-peagle demo (embedded)".

    ``what`` may name the ``method`` or ``part`` parameter in braces ("train-{method}"); an unset
    method falls back to the config's (``train.method``).
    """

    def name() -> str:
        from prefect.runtime import flow_run

        params = flow_run.parameters
        try:
            cfg = load_config(params[config_param], params.get("overrides"))
        except Exception:  # the flow itself reports a bad config, with the reason
            return f"{what.split('-{')[0]} {Path(str(params.get(config_param, '?'))).stem}"
        method = params.get("method") or cfg.train.method
        return f"{what.format(method=method, part=params.get('part'))} {cfg.name} ({target_label(cfg.target.model)})"

    return name


# ----------------------------------------------------------------------------- logs


class _InARun(logging.Filter):
    """Only records emitted inside a flow or task run can be attached to one."""

    def filter(self, record: logging.LogRecord) -> bool:
        from prefect.context import FlowRunContext, TaskRunContext

        return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def send_peagle_logs_to_prefect(level: int = logging.INFO) -> None:
    """Attach Prefect's API log handler to the ``peagle`` logger (what
    ``PREFECT_LOGGING_EXTRA_LOGGERS=peagle`` does, but also when Prefect was imported
    first, as in a worker's flow-run process) and log at ``level``; idempotent."""
    from prefect.logging.handlers import APILogHandler

    logger = logging.getLogger(ROOT)
    if logger.level == logging.NOTSET or logger.level > level:
        logger.setLevel(level)
    if not any(isinstance(h, APILogHandler) for h in logger.handlers):
        handler = APILogHandler()
        handler.addFilter(_InARun())
        logger.addHandler(handler)


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    """The current flow/task run's logger; a plain logger when called outside any run."""
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("flows")


@contextlib.contextmanager
def run_logs(cfg: PipelineConfig):
    """Library output (vLLM, DeepSpeed, torch, transformers) into ``<run>/logs/libraries.log``
    for the flow's duration; our own lines stay on the console and in Prefect."""
    with run_library_output(cfg.run_dir) as path:
        yield path


# ----------------------------------------------------------------------------- accelerator limit


def ensure_accelerator_limit(cfg: PipelineConfig) -> None:
    """Create the global concurrency limit (``orchestration.accelerator_limit``) if missing,
    with ``accelerator_slots`` slots; an existing limit is left as its owner set it
    (``prefect gcl create peagle-accelerator --limit 1``, or update it in the UI)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    orch = cfg.orchestration
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(orch.accelerator_limit)
            return
        except ObjectNotFound:
            pass
        with contextlib.suppress(ObjectAlreadyExists):  # another run created it meanwhile
            client.create_global_concurrency_limit(
                GlobalConcurrencyLimitCreate(name=orch.accelerator_limit, limit=orch.accelerator_slots))
            logging.getLogger(__name__).info("created global concurrency limit %r with %d slot(s)",
                                             orch.accelerator_limit, orch.accelerator_slots)


# A wait for the accelerator longer than this is said in the run's log, with how to free a stale slot.
ACCELERATOR_WAIT_NOTICE_S = 60.0


@contextlib.contextmanager
def on_accelerator(cfg: PipelineConfig, notice_after_s: float = ACCELERATOR_WAIT_NOTICE_S):
    """Hold one slot of the accelerator limit: a second run on the host waits here.

    A wait past ``notice_after_s`` is logged (then the run waits on): it is either another run
    on this accelerator or a slot a killed run left taken. Prefect expires a lease its holder
    stopped renewing, but a temporary server (``peagle run`` without a server) keeps leases in
    its own memory, so when that process dies the slot stays taken in the database for good.
    """
    from prefect.concurrency.sync import concurrency

    name = cfg.orchestration.accelerator_limit
    held = contextlib.ExitStack()
    try:
        held.enter_context(concurrency(name, occupy=1, strict=True, timeout_seconds=notice_after_s))
    except TimeoutError:  # raised only by the acquisition: the stage's body runs below, outside this try
        run_logger().warning("%s", accelerator_wait_notice(name, notice_after_s))
        held.enter_context(concurrency(name, occupy=1, strict=True))
    with held:
        yield


def accelerator_wait_notice(name: str, waited_s: float) -> str:
    """Who holds the accelerator limit's slots, and the command that frees a stale one."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name(name)
    return (f"waiting {waited_s:.0f} s so far for a slot of the global concurrency limit {name!r} "
            f"({limit.active_slots} of {limit.limit} taken); waiting on. Either another run is using the "
            f"accelerator, or a run that was killed left its slot taken (a temporary Prefect server forgets "
            f"its leases when it stops). If no other run is working, free the slots: "
            f"prefect gcl update {name} --active-slots 0")


def result_storage(cfg: PipelineConfig) -> Path:
    """Where cached task results of this run live: inside the run directory."""
    return cfg.run_dir / RESULTS_DIR


def cache_key_from_param(context, parameters) -> str:
    """Tasks take their cache key as the ``key`` parameter, computed by a named function."""
    return parameters["key"]


# ----------------------------------------------------------------------------- retries


TRANSIENT_MESSAGES = ("Connection refused", "Max retries exceeded", "Temporary failure in name resolution",
                      "Connection reset", "timed out", "503 Service Unavailable", "502 Bad Gateway")


def is_transient(exc: BaseException | None) -> bool:
    """vLLM engine start failures and tracking-server connection errors are worth a retry."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, EngineStartError | ConnectionError | TimeoutError) or getattr(exc, "transient", False):
            return True
        name = type(exc).__name__
        if name in {"ConnectError", "ConnectTimeout", "ReadTimeout"}:  # requests / httpx
            return True
        if name == "MlflowException" and any(m in str(exc) for m in TRANSIENT_MESSAGES):
            return True
        if type(exc).__module__.startswith("requests") and name == "ConnectionError":
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def retry_if_transient(task, task_run, state) -> bool:
    """Prefect ``retry_condition_fn``: retry only what :func:`is_transient` accepts."""
    try:
        state.result(raise_on_failure=True)
    except BaseException as exc:  # the task's own exception
        return is_transient(exc)
    return False


# ----------------------------------------------------------------------------- artifacts


def acceptance_markdown(online, title: str = "Tokens per target step and acceptance length in vLLM") -> str:
    """The online table as markdown (one row per method, K and concurrency), with what its columns are."""
    from peagle.eval.online import TABLE_CAPTION

    lines = [f"### {title}", "", f"target `{online.target}`, prompt set `{online.prompt_set}`, "
             f"max_tokens {online.max_tokens}, greedy", "",
             "| method | K | concurrency | tokens/step | vLLM acc. length | output tok/s | speedup |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in online.rows:
        accept = f"{r.acceptance_length:.3f}" if r.acceptance_length is not None else "-"
        speedup = online.speedup(r)
        lines.append(f"| {r.method} | {r.k} | {r.concurrency} | {r.tokens_per_step_text()} | {accept} | "
                     f"{r.output_tokens_per_s:.1f} | {f'{speedup:.2f}x' if speedup else '-'} |")
    return "\n".join([*lines, "", TABLE_CAPTION])


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys: lowercase letters, digits and dashes only."""
    raw = "-".join(parts).lower()
    return "".join(c if c.isalnum() else "-" for c in raw).strip("-")[:100]


def publish_acceptance_artifact(online, config_name: str) -> None:
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(acceptance_markdown(online), key=artifact_key(config_name, "acceptance"),
                             description="Acceptance per K measured in vLLM")


def publish_mlflow_artifact(run_url: str | None, run_id: str | None, config_name: str) -> None:
    """A link artifact for an MLflow server; for a local store, the command that opens it."""
    from prefect.artifacts import create_link_artifact, create_markdown_artifact

    if not run_url:
        return
    key = artifact_key(config_name, "mlflow-run")
    if run_url.startswith(("http://", "https://")):
        create_link_artifact(run_url, link_text=f"MLflow run {run_id}", key=key)
    else:
        create_markdown_artifact(f"MLflow run `{run_id}`: `{run_url}`", key=key, description="MLflow run")
