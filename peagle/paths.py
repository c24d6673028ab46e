"""Where peagle's own outputs live, and the process environment every entry point sets up.

Only peagle's outputs (targets, runs, the default MLflow SQLite store) default to
``PEAGLE_HOME`` (``<repo>/.peagle``). Libraries keep their own homes and settings
(``~/.cache/huggingface`` with its ``hf auth login`` token, the Prefect profile in
``~/.prefect``, ``~/.cache/vllm``, ...) unless the user moves them, so a cached 16 GB
target or a configured Prefect API is found as the user left it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

# Telemetry and noise switches only: none moves a library's home or changes where runs go,
# and each is a default the user's own environment overrides.
QUIET_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    "DISABLE_MLFLOW_INTEGRATION": "TRUE",  # transformers' auto-logging would open MLflow runs of its own
    "WANDB_ERROR_REPORTING": "false",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


def peagle_home() -> Path:
    """The root of peagle's own outputs; ``PEAGLE_HOME`` overrides the repo-local default."""
    return Path(os.environ.get("PEAGLE_HOME", REPO_ROOT / ".peagle")).resolve()


def configure_environment() -> None:
    """Set the quiet defaults above; called once by each entry point, before libraries load.

    Only fills variables the user has not set; library homes and Prefect's API and log
    level are left to the user's environment and profiles.
    """
    for key, value in QUIET_DEFAULTS.items():
        os.environ.setdefault(key, value)


def mark_absent(*modules: str) -> None:
    """Mark ``modules`` absent in this process, as where they are not installed: importing one
    raises ImportError, and a library that probes for it (``importlib.util.find_spec``) goes on
    without it. For libraries a peagle process never calls that others import whenever they
    are installed, at seconds of start-up each: transformers imports scikit-learn as it loads any
    model class (for assisted generation, which peagle does not run), DeepSpeed imports MLflow
    (for an autotuner peagle does not run). Entry points only: a program that imports peagle as a
    library keeps its own modules. One this process already imported is kept."""
    for name in modules:
        sys.modules.setdefault(name, None)


def library_homes() -> dict:
    """Where the libraries peagle drives keep their caches and login, as this process resolves
    them; ``hf_token_found`` says whether a Hugging Face token is available (never the token)."""
    import huggingface_hub
    from huggingface_hub import constants

    return {
        "peagle_home": str(peagle_home()),
        "hf_home": constants.HF_HOME,
        "hf_token_found": huggingface_hub.get_token() is not None,
        "vllm_cache_root": os.environ.get("VLLM_CACHE_ROOT"),  # None: vLLM's own default (~/.cache/vllm)
    }
