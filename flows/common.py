"""What every peagle flow shares: retry rules, cache keys and Prefect artifacts.

Caching: a cached task's key is computed by a named function from the inputs that
decide its output (config section hashes, prompt-file hashes, target revision, dataset
manifests, head file hashes). Results are stored as JSON (no pickle). A key is only
trusted while the files it points to still exist: the caller passes ``refresh_cache``
when they do not.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

RESULT_SERIALIZER = "json"
RETRIES = 2
RETRY_DELAY_S = 15


def digest(*parts) -> str:
    blob = json.dumps([str(p) for p in parts]).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def cache_key_from_param(context, parameters) -> str:
    """Tasks take their cache key as the ``key`` parameter, computed by a named function."""
    return parameters["key"]


# ----------------------------------------------------------------------------- retries


TRANSIENT_MESSAGES = ("Connection refused", "Max retries exceeded", "Temporary failure in name resolution",
                      "Connection reset", "timed out", "503 Service Unavailable", "502 Bad Gateway")


def is_transient(exc: BaseException | None) -> bool:
    """vLLM engine start failures and tracking-server connection errors are worth a retry."""
    from peagle.serving.engine import EngineStartError

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, EngineStartError | ConnectionError | TimeoutError):
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


def acceptance_markdown(online, title: str = "Acceptance length in vLLM") -> str:
    """The online acceptance table as markdown (one row per method, K and concurrency)."""
    lines = [f"### {title}", "", f"target `{online.target}`, prompt set `{online.prompt_set}`, "
             f"max_tokens {online.max_tokens}, greedy", "",
             "| method | K | concurrency | acceptance length | output tok/s | speedup |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in online.rows:
        accept = f"{r.acceptance_length:.3f}" if r.acceptance_length is not None else "-"
        speedup = online.speedup(r)
        lines.append(f"| {r.method} | {r.k} | {r.concurrency} | {accept} | {r.output_tokens_per_s:.1f} | "
                     f"{f'{speedup:.2f}x' if speedup else '-'} |")
    return "\n".join(lines)


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


def path_exists(path: str | Path | None) -> bool:
    return path is not None and Path(path).exists()
