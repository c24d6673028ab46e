"""Where everything lives: one project-local, git-ignored home for caches and outputs.

Every cache (HF, vLLM, Prefect, MLflow, torch extensions) and every output (targets,
datasets, checkpoints, heads) goes under ``PEAGLE_HOME`` (default ``<repo>/.peagle``)
unless a config says otherwise, so a clone never writes to ``~``.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def peagle_home() -> Path:
    """The root for caches and outputs; ``PEAGLE_HOME`` overrides the repo-local default."""
    return Path(os.environ.get("PEAGLE_HOME", REPO_ROOT / ".peagle")).resolve()


def cache_dir(name: str) -> Path:
    path = peagle_home() / "cache" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def configure_environment() -> None:
    """Point every library cache at the project home and keep libraries offline-friendly.

    Only sets variables the user has not set, so a real deployment's settings win.
    """
    home = peagle_home()
    defaults = {
        "HF_HOME": home / "cache" / "hf",
        "VLLM_CACHE_ROOT": home / "cache" / "vllm",
        "PREFECT_HOME": home / "prefect",
        "PREFECT_MEMO_STORE_PATH": home / "prefect" / "memo_store.toml",
        # Prefect 3.7 keeps cached task results in ~/.prefect/storage even when PREFECT_HOME is set.
        "PREFECT_LOCAL_STORAGE_PATH": home / "prefect" / "storage",
        "TORCH_EXTENSIONS_DIR": home / "cache" / "torch_extensions",
        "TRITON_CACHE_DIR": home / "cache" / "triton",
        "MPLCONFIGDIR": home / "cache" / "matplotlib",
        "WANDB_DIR": home / "wandb",
        "WANDB_CONFIG_DIR": home / "wandb" / "config",
        "WANDB_CACHE_DIR": home / "wandb" / "cache",
        "WANDB_DATA_DIR": home / "wandb" / "data",
        "WANDB_ARTIFACT_DIR": home / "wandb" / "artifacts",
    }
    for key, value in defaults.items():
        if key not in os.environ:
            Path(value).parent.mkdir(parents=True, exist_ok=True)
            os.environ[key] = str(value)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("DISABLE_MLFLOW_INTEGRATION", "TRUE")
