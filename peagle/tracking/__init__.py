"""MLflow (and wandb) tracking of pipeline runs, and the registry gate (challenger/champion).

Names are imported lazily: ``import peagle.tracking`` stays cheap, and MLflow (a slow
import) loads only when a tracker or the registry is used.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Tracker": "peagle.tracking.mlflow_run",
    "RunLogger": "peagle.tracking.mlflow_run",
    "resolve_tracking_uri": "peagle.tracking.mlflow_run",
    "registered_model_name": "peagle.tracking.mlflow_run",
    "PromotionDecision": "peagle.tracking.gate",
    "register_head": "peagle.tracking.registry",
    "promote_if_better": "peagle.tracking.gate",
    "download_champion": "peagle.tracking.pull",
    "weighted_score": "peagle.tracking.gate",
    "scrub": "peagle.tracking.scrub",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'peagle.tracking' has no attribute {name!r}")
