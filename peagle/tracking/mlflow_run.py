"""MLflow tracking for one pipeline run.

One experiment per target (``peagle/<target>``), one parent run per pipeline run and a
nested run per stage, so the MLflow UI shows each run's stages side by side. The
tracker only receives values (configs, metrics, paths); it never reaches into other
stages. Everything sent is scrubbed of credentials first (``peagle.tracking.scrub``).

    with Tracker(cfg.tracking, target_id, cfg) as tracker:
        with tracker.stage("train", system_metrics=True) as stage:
            stage.log_metrics({"loss": 1.2}, step=10)
        tracker.log_metrics_per_k({1: 0.8, 3: 0.6}, "acceptance")
        print(tracker.run_url())

A stage run the tracker has open is found again by its id (``stage_run``): the training
launcher streams rank 0's step records into it while the ranks run.

The tracking URI comes from the config, else ``MLFLOW_TRACKING_URI``, else a SQLite
store under the project home. A remote server (``http://...``) works the same way; its
credentials come from MLflow's own environment variables (MLFLOW_TRACKING_TOKEN, ...).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import time
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote

import yaml
from mlflow import MlflowClient
from mlflow.data import Dataset
from mlflow.entities import Dataset as DatasetEntity
from mlflow.entities import DatasetInput, InputTag, Metric, Param, RunStatus, RunTag
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode
from mlflow.utils.mlflow_tags import (
    MLFLOW_DATASET_CONTEXT,
    MLFLOW_GIT_COMMIT,
    MLFLOW_PARENT_RUN_ID,
    MLFLOW_SOURCE_NAME,
)
from mlflow.utils.validation import (
    MAX_ENTITY_KEY_LENGTH,
    MAX_METRICS_PER_BATCH,
    MAX_PARAM_VAL_LENGTH,
    MAX_PARAMS_TAGS_PER_BATCH,
    MAX_TAG_VAL_LENGTH,
)

from peagle.config import ConfigError, PipelineConfig, TrackingConfig
from peagle.fileio import json_digest
from peagle.fileio import sha256_file as file_sha256
from peagle.paths import REPO_ROOT, peagle_home
from peagle.tracking.scrub import scrub, scrub_text
from peagle.tracking.wandb_mirror import WandbMirror, check_wandb_credentials

TAG_TARGET = "peagle.target"
TAG_GIT_COMMIT = "peagle.git.commit"
TAG_GIT_DIRTY = "peagle.git.dirty"
TAG_CONFIG_HASH = "peagle.config_hash"
TAG_STAGE = "peagle.stage"
TAG_WANDB_RUN = "peagle.wandb.run"


log = logging.getLogger(__name__)


def manifest_tag(split: str) -> str:
    return f"peagle.data.{split}.manifest_sha256"


# ---------------------------------------------------------------------------------------
# Where runs go


def default_tracking_uri() -> str:
    return f"sqlite:///{peagle_home() / 'mlflow' / 'mlflow.db'}"


def resolve_tracking_uri(tracking: TrackingConfig) -> str:
    """The config's URI, else ``MLFLOW_TRACKING_URI``, else SQLite under the project home."""
    return tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()


def sqlite_db_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (None for any other store)."""
    if not uri.startswith("sqlite:///"):
        return None
    path = unquote(uri[len("sqlite:///"):].split("?", 1)[0])  # "/abs.db" or "relative.db"
    return Path(path).resolve() if path and path != ":memory:" else None


def local_artifact_location(uri: str) -> str | None:
    """Artifacts beside a local SQLite store; MLflow would otherwise write ``./mlruns`` in the cwd."""
    db = sqlite_db_path(uri)
    return (db.parent / "artifacts").as_uri() if db else None


def sanitize_target_id(target_id: str) -> str:
    """A target id usable in experiment and model names: ``org/model`` -> ``org--model``."""
    cleaned = re.sub(r"[/:\\]+", "--", target_id.strip().strip("/\\"))
    cleaned = re.sub(r"[^A-Za-z0-9._\-]+", "_", cleaned).strip("._-")
    if not cleaned:
        raise ValueError(f"target id {target_id!r} has no usable characters for an experiment name")
    return cleaned


def experiment_name(tracking: TrackingConfig, target_id: str) -> str:
    return tracking.experiment or f"peagle/{sanitize_target_id(target_id)}"


def registered_model_name(tracking: TrackingConfig, target_id: str) -> str:
    return tracking.registered_model or f"peagle-{sanitize_target_id(target_id)}"


def make_client(uri: str) -> MlflowClient:
    """A client whose registry is the tracking store unless MLFLOW_REGISTRY_URI says otherwise;
    a tracking server that does not answer is refused first (``require_tracking_server``)."""
    registry = os.environ.get("MLFLOW_REGISTRY_URI") or uri
    require_tracking_server(uri)
    db = sqlite_db_path(uri)
    if db:
        db.parent.mkdir(parents=True, exist_ok=True)
    return MlflowClient(tracking_uri=uri, registry_uri=registry)


SERVER_CHECK_TIMEOUT_S = 10.0  # a server that takes longer to answer its health check is down for us
_ANSWERED: set[str] = set()  # servers that answered once in this process


def require_tracking_server(uri: str) -> None:
    """The MLflow server of tracking URI ``uri``, and of MLFLOW_REGISTRY_URI when that names
    another, answers (``ServiceUnavailable`` otherwise): what a client of ``make_client`` talks to."""
    _require_answer(uri, "tracking", "MLFLOW_TRACKING_URI")
    registry = os.environ.get("MLFLOW_REGISTRY_URI")
    if registry and registry != uri:
        _require_answer(registry, "registry", "MLFLOW_REGISTRY_URI")


def _require_answer(uri: str, what: str, variable: str) -> None:
    """An ``http(s)://`` URI must answer MLflow's ``/health`` (a server behind authentication
    counts), else ``ServiceUnavailable`` naming it, how to start a server and where peagle reads
    the URI: in seconds, not after MLflow's own retries. Local stores and other schemes pass."""
    if not uri.startswith(("http://", "https://")) or uri in _ANSWERED:
        return
    import requests

    from peagle.services import ServiceUnavailable

    try:
        status = requests.get(f"{uri.rstrip('/')}/health", timeout=SERVER_CHECK_TIMEOUT_S).status_code
        problem = None if status < 400 or status in (401, 403) else f"answers HTTP {status} to /health: no MLflow server"
    except requests.RequestException as err:
        errno = re.search(r"\[Errno -?\d+\] [^'\")]+", str(err))  # "[Errno 111] Connection refused", not urllib3's chain
        problem = f"does not answer ({errno.group(0) if errno else type(err).__name__})"
    if problem:
        raise ServiceUnavailable(
            f"MLflow {what} server {scrub_text(uri)}", problem,
            "start it (`mlflow server --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1 --port 5000`) or "
            f"point {variable}{' (or tracking.tracking_uri, or --tracking-uri)' if what == 'tracking' else ''} at a "
            "running one; with none set, peagle tracks into a local SQLite store", transient=True,
        ) from None
    _ANSWERED.add(uri)


class TrackingStoreMissing(ConfigError):
    """A read from a local SQLite store whose file does not exist (a mistyped path, usually)."""


def read_client(uri: str) -> MlflowClient:
    """A client for reading a store that must exist already (``peagle pull``, the champion the
    gate measures). MLflow would create an empty database at a mistyped ``sqlite:///`` path and
    then answer that nothing is registered; that is refused here, naming the path."""
    for what, store in (("tracking", uri), ("registry", os.environ.get("MLFLOW_REGISTRY_URI") or uri)):
        db = sqlite_db_path(store)
        if db is not None and not db.is_file():
            raise TrackingStoreMissing(
                f"MLflow {what} URI {store}: no database at {db} (a read never creates one). Check "
                f"--tracking-uri, MLFLOW_TRACKING_URI or tracking.tracking_uri: {_sqlite_path_hint(store)}"
            )
    return make_client(uri)


def _sqlite_path_hint(uri: str) -> str:
    rest = unquote(uri[len("sqlite:///"):].split("?", 1)[0])
    if rest and not rest.startswith("/") and Path("/" + rest).is_file():
        return f"did you mean sqlite:////{rest}? (/{rest} exists; three slashes make the path relative to " \
               "the working directory, four absolute)"
    return "three slashes (sqlite:///mlflow.db) make the path relative to the working directory, four " \
           "(sqlite:////srv/mlflow.db) absolute"


def ensure_experiment(client: MlflowClient, name: str, uri: str) -> str:
    """The id of experiment ``name``, created (with local artifacts for SQLite) when missing."""
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            raise MlflowException(
                f"experiment {name!r} was deleted; restore it (mlflow experiments restore) "
                "or set tracking.experiment to another name"
            )
        return exp.experiment_id
    try:
        return client.create_experiment(name, artifact_location=local_artifact_location(uri))
    except MlflowException as err:  # created meanwhile by a concurrent run
        if err.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise
        return client.get_experiment_by_name(name).experiment_id


# ---------------------------------------------------------------------------------------
# What runs record


def flatten_params(obj, prefix: str = "") -> dict[str, str]:
    """Nested dicts/lists -> ``{"train.peagle.k_train": "8", "data.sources.0.kind": "jsonl"}``.

    Lists of scalars stay one value (``eval.ks = [1, 3, 5]``); values longer than MLflow's
    param limit are truncated with a marker.
    """
    out: dict[str, str] = {}
    if isinstance(obj, dict) and obj:
        for k, v in obj.items():
            out.update(flatten_params(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)) and obj and any(isinstance(v, (dict, list, tuple)) for v in obj):
        for i, v in enumerate(obj):
            out.update(flatten_params(v, f"{prefix}.{i}"))
    else:
        out[prefix or "value"] = _truncate(str(list(obj) if isinstance(obj, tuple) else obj), MAX_PARAM_VAL_LENGTH)
    return out


def _truncate(text: str, limit: int) -> str:
    marker = "...[truncated]"
    return text if len(text) <= limit else text[: limit - len(marker)] + marker


def _safe_key(key: str) -> str:
    """MLflow keys allow letters, digits, ``_ - . / space``; anything else becomes ``_``."""
    return re.sub(r"[^\w\-./ ]", "_", key)[:MAX_ENTITY_KEY_LENGTH]


def config_hash(cfg: PipelineConfig) -> str:
    """A stable hash of the whole resolved config (two runs with one hash ran the same recipe)."""
    return json_digest(cfg.model_dump(mode="json", by_alias=True))


def git_state(repo_dir: Path) -> dict[str, str]:
    """Commit of ``repo_dir`` and whether its tree has uncommitted changes (empty if not a repo)."""
    def git(*args):
        return subprocess.run(["git", "-C", str(repo_dir), *args], capture_output=True, text=True, timeout=20)

    try:
        head = git("rev-parse", "HEAD")
        status = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return {}
    state = {}
    if head.returncode == 0:
        state[TAG_GIT_COMMIT] = state[MLFLOW_GIT_COMMIT] = head.stdout.strip()
    if status.returncode == 0:
        state[TAG_GIT_DIRTY] = str(bool(status.stdout.strip())).lower()
    return state


def _now_ms() -> int:
    return int(time.time() * 1000)


STEP_RECORD_META = ("step", "time")  # what a step record says about itself, not a metric


def step_record_metrics(record: dict) -> dict[str, float]:
    """The metrics of one of rank 0's ``metrics.jsonl`` records: its numbers, less step and time."""
    return {k: float(v) for k, v in record.items()
            if k not in STEP_RECORD_META and isinstance(v, int | float) and not isinstance(v, bool)}


class RunLogger:
    """Logging calls bound to one MLflow run: the pipeline's parent run or a stage's nested run."""

    def __init__(self, client: MlflowClient, run_id: str, mirror=None, namespace: str = ""):
        self.client = client
        self.run_id = run_id
        self._mirror = mirror
        self._namespace = namespace  # wandb key prefix of a stage ("train/")
        self._last_step: dict[str, int] = {}  # per key, the last step log_step_records sent

    def log_params(self, params: dict) -> None:
        """Nested or flat params; flattened to dot keys, scrubbed and truncated."""
        flat = {_safe_key(k): v for k, v in flatten_params(scrub(params)).items()}
        items = [Param(k, v) for k, v in flat.items()]
        for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i : i + MAX_PARAMS_TAGS_PER_BATCH])
        if self._mirror:
            self._mirror.log_params({f"{self._namespace}{k}": v for k, v in flat.items()})

    def set_tags(self, tags: dict) -> None:
        items = [RunTag(_safe_key(str(k)), _truncate(scrub_text(str(v)), MAX_TAG_VAL_LENGTH)) for k, v in tags.items()]
        for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, tags=items[i : i + MAX_PARAMS_TAGS_PER_BATCH])

    def log_metrics(self, metrics: dict[str, float], step: int | None = None,
                    timestamp_ms: int | None = None) -> None:
        """Numbers only; a non-numeric value is an error naming its key. The timestamp is
        now unless given (a step measured earlier keeps the time it was measured)."""
        values = {}
        for key, value in metrics.items():
            try:
                values[_safe_key(key)] = float(value)
            except (TypeError, ValueError):
                raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}") from None
        self._send([Metric(k, v, timestamp_ms or _now_ms(), step or 0) for k, v in values.items()])
        if self._mirror:
            self._mirror.log_metrics(values, step, self._namespace)

    def log_step_records(self, records: Iterable[dict]) -> int:
        """Rank 0's step records (``{"step": 7, "time": 1.7e9, "loss": 0.9, "lr": 1e-3, ...}``)
        at their own step and timestamp, in as few requests as MLflow allows.

        Steps of a key at or below the last one this logger sent are skipped, so the records
        streamed while training and the whole history sent after it never double a point.
        Returns the number of points sent.
        """
        last, points, steps = dict(self._last_step), [], []
        for record in records:
            step = int(record["step"])
            stamp = int(float(record["time"]) * 1000) if "time" in record else _now_ms()
            values = {_safe_key(k): v for k, v in step_record_metrics(record).items()}
            values = {k: v for k, v in values.items() if step > last.get(k, -1)}
            if values:
                points += [Metric(k, v, stamp, step) for k, v in values.items()]
                steps.append((values, step))
                last.update(dict.fromkeys(values, step))
        self._send(points)
        self._last_step = last  # only once MLflow has them: a failed send is retried by the next call
        if self._mirror:
            for values, step in steps:
                self._mirror.log_metrics(values, step, self._namespace)
        return len(points)

    def _send(self, metrics: list[Metric]) -> None:
        for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + MAX_METRICS_PER_BATCH])

    def log_input(self, dataset: Dataset, context: str) -> None:
        """A dataset (``mlflow.data``) as an input of this run, as ``mlflow.log_input`` logs it
        (its name, source and profile scrubbed: paths and URIs can carry credentials)."""
        described = dataset.to_dict()
        for field in ("name", "source", "profile"):
            if described.get(field):
                described[field] = scrub_text(described[field])
        entity = DatasetEntity(**described)
        tags = [InputTag(MLFLOW_DATASET_CONTEXT, context)]
        self.client.log_inputs(self.run_id, datasets=[DatasetInput(dataset=entity, tags=tags)])

    def log_metrics_per_k(self, values: dict[int, float], name: str) -> None:
        """A curve over K: ``name`` with step = K (MLflow plots it against K) plus ``name_kK`` columns."""
        for k in sorted(values):
            if int(k) < 1:
                raise ValueError(f"{name}: K must be >= 1, got {k}")
            self.log_metrics({name: values[k]}, step=int(k))
        self.log_metrics({f"{name}_k{int(k)}": v for k, v in values.items()})

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"artifact {path} is not a file (use log_artifacts for a directory)")
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_artifacts(self, local_dir: str | Path, artifact_path: str | None = None) -> None:
        local_dir = Path(local_dir)
        if not local_dir.is_dir():
            raise NotADirectoryError(f"artifact directory {local_dir} does not exist")
        self.client.log_artifacts(self.run_id, str(local_dir), artifact_path)

    def log_text(self, text: str, artifact_file: str) -> None:
        """A small text artifact (scrubbed), e.g. a report or a resolved config."""
        self.client.log_text(self.run_id, scrub_text(text), artifact_file)

    def artifact_uri(self) -> str:
        return self.client.get_run(self.run_id).info.artifact_uri


class Tracker(RunLogger):
    """The MLflow parent run of one pipeline run (a context manager); stages nest under it.

    ``run_id`` resumes an existing parent run (e.g. from another process of the same
    pipeline run). ``config`` is logged (params + YAML artifact) on entry when given.
    """

    def __init__(
        self,
        tracking: TrackingConfig,
        target_id: str,
        config: PipelineConfig | None = None,
        *,
        run_name: str | None = None,
        run_id: str | None = None,
        repo_dir: Path = REPO_ROOT,
    ):
        check_wandb_credentials(tracking.wandb)  # before any run exists
        self.tracking = tracking
        self.target_id = target_id
        self.config = config
        self.run_name = run_name or (config.name if config else None)
        self.tracking_uri = resolve_tracking_uri(tracking)
        self.experiment_name = experiment_name(tracking, target_id)
        self.registered_model_name = registered_model_name(tracking, target_id)
        self.experiment_id: str | None = None
        self._resume_id = run_id
        self._git = git_state(Path(repo_dir))
        super().__init__(make_client(self.tracking_uri), run_id or "")

    # -- lifecycle ------------------------------------------------------------------
    def __enter__(self) -> Tracker:
        try:
            self.start()
        except BaseException as exc:  # never leave a run marked RUNNING forever
            if self.run_id:
                self.end(_status_for(type(exc)), error=exc)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.end(_status_for(exc_type), error=exc)

    def start(self) -> Tracker:
        self.experiment_id = ensure_experiment(self.client, self.experiment_name, self.tracking_uri)
        if self._resume_id:
            run = self.client.get_run(self._resume_id)
            if run.info.experiment_id != self.experiment_id:
                raise ValueError(f"run {self._resume_id} belongs to experiment {run.info.experiment_id}, "
                                 f"not {self.experiment_name!r}")
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            run = self.client.create_run(self.experiment_id, run_name=self.run_name, tags=self._start_tags())
            self.run_id = run.info.run_id
        if self.tracking.wandb.enabled:
            self._mirror = WandbMirror.start(
                self.tracking.wandb, name=self.run_name, group=self.experiment_name,
                tags=[sanitize_target_id(self.target_id)],
                meta={"mlflow_run_id": self.run_id, "mlflow_experiment": self.experiment_name},
            )
            self.set_tags({TAG_WANDB_RUN: self._mirror.run_path})
        if self.config is not None:
            self.log_config(self.config)
        return self

    def end(self, status: str = "FINISHED", error: BaseException | None = None) -> None:
        if error is not None:
            self.set_tags({"peagle.error": _truncate(f"{type(error).__name__}: {error}", 4000)})
        self.client.set_terminated(self.run_id, status=status)
        if self._mirror:
            self._mirror.finish(failed=status != "FINISHED")

    def _start_tags(self) -> dict[str, str]:
        return {TAG_TARGET: scrub_text(self.target_id), MLFLOW_SOURCE_NAME: "peagle", **self._git}

    # -- stages ---------------------------------------------------------------------
    @contextmanager
    def stage(self, name: str, *, system_metrics: bool = False):
        """A nested run for one stage; its wall-clock seconds land on both runs.

        ``system_metrics``: MLflow's system metrics (``system/cpu_utilization_percentage``,
        memory, disk, network; GPU when nvidia-ml-py is installed) sampled on this host every
        ``tracking.system_metrics_interval_s`` while the stage runs.
        """
        run = self.client.create_run(
            self.experiment_id,
            run_name=name,
            tags={MLFLOW_PARENT_RUN_ID: self.run_id, TAG_STAGE: name, **self._start_tags()},
        )
        stage = RunLogger(self.client, run.info.run_id, self._mirror, namespace=f"{name}/")
        _OPEN_STAGES[stage.run_id] = stage
        start = time.perf_counter()
        status, error, monitor = "FINISHED", None, None
        try:
            monitor = self._system_monitor(stage.run_id) if system_metrics else None
            yield stage
        except BaseException as exc:
            status, error = _status_for(type(exc)), exc
            raise
        finally:
            _OPEN_STAGES.pop(stage.run_id, None)
            if monitor is not None:
                monitor.finish()  # flushes the samples taken so far
            seconds = time.perf_counter() - start
            if error is not None:
                stage.set_tags({"peagle.error": _truncate(f"{type(error).__name__}: {error}", 4000)})
            stage.log_metrics({"duration_s": seconds})
            self.log_metrics({f"{name}.duration_s": seconds})
            self.client.set_terminated(stage.run_id, status=status)

    def _system_monitor(self, run_id: str):
        """MLflow's own system-metrics sampler on ``run_id`` (started), or None when switched off."""
        interval = self.tracking.system_metrics_interval_s
        if interval is None:
            return None
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            monitor = SystemMetricsMonitor(run_id, sampling_interval=interval, tracking_uri=self.tracking_uri)
        except ImportError as err:  # psutil is one of peagle's dependencies; a broken env should still train
            log.warning("no system metrics for this run (%s); pip install psutil", err)
            return None
        monitor.start()
        return monitor

    # -- what the pipeline run is ---------------------------------------------------
    def log_config(self, cfg: PipelineConfig) -> None:
        """The fully resolved config (defaults included): flattened params plus
        ``config/pipeline.yaml``, which ``load_config`` reads back; both scrubbed."""
        resolved = scrub(cfg.model_dump(mode="json", by_alias=True))
        self.log_params(resolved)
        self.set_tags({TAG_CONFIG_HASH: config_hash(cfg), "peagle.run_dir": str(cfg.run_dir)})
        self.log_text(yaml.safe_dump(resolved, sort_keys=False), "config/pipeline.yaml")

    def set_data_manifest(self, manifest: str | Path, split: str = "train") -> str:
        """Lineage: tag the run with a dataset manifest's sha256 (given, or hashed from the file,
        which is then also logged under ``lineage/<split>/``). Returns the hash."""
        if re.fullmatch(r"[0-9a-f]{64}", str(manifest)):
            digest = str(manifest)
        else:
            path = Path(manifest)
            if not path.is_file():
                raise FileNotFoundError(
                    f"data manifest {path} not found (expected <run>/data/splits/<split>/manifest.json)"
                )
            digest = file_sha256(path)
            self.log_artifact(path, f"lineage/{split}")
        self.set_tags({manifest_tag(split): digest})
        return digest

    def run_url(self) -> str:
        """Where to look at this run: a web URL for a server, the ``mlflow ui`` command for local stores."""
        uri = self.tracking_uri
        if uri.startswith(("http://", "https://")):
            base = scrub_text(uri).rstrip("/")
            return f"{base}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
        if uri.startswith(("sqlite:", "postgresql", "mysql", "mssql", "file:")) or "://" not in uri:
            return (f"mlflow ui --backend-store-uri '{scrub_text(uri)}'  then open "
                    f"http://127.0.0.1:5000/#/experiments/{self.experiment_id}/runs/{self.run_id}  "
                    f"(run {self.run_id})")
        return f"runs:/{self.run_id} (tracking URI {scrub_text(uri)})"


_OPEN_STAGES: dict[str, RunLogger] = {}  # stage runs open in this process, by run id


def stage_run(tracking: TrackingConfig, run_id: str) -> RunLogger:
    """The stage run ``run_id``: the one a tracker of this process has open (with its wandb
    mirror and what it already logged), else a logger on the tracking server's run."""
    return _OPEN_STAGES.get(run_id) or RunLogger(make_client(resolve_tracking_uri(tracking)), run_id)


def _status_for(exc_type) -> str:
    if exc_type is None:
        return RunStatus.to_string(RunStatus.FINISHED)
    if issubclass(exc_type, KeyboardInterrupt):
        return RunStatus.to_string(RunStatus.KILLED)
    return RunStatus.to_string(RunStatus.FAILED)


__all__ = [
    "RunLogger",
    "Tracker",
    "default_tracking_uri",
    "experiment_name",
    "flatten_params",
    "git_state",
    "local_artifact_location",
    "make_client",
    "read_client",
    "registered_model_name",
    "require_tracking_server",
    "resolve_tracking_uri",
    "sanitize_target_id",
    "stage_run",
    "step_record_metrics",
]
