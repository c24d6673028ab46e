"""Mirror a pipeline run's params and metrics into Weights & Biases.

MLflow stays the system of record (registry, artifacts); wandb gets the same params and
metrics for teams that live there. Offline mode works without a network (``wandb sync``
uploads later). The API key is read by wandb from ``WANDB_API_KEY`` only: never from a
config file, never written by us. The run files are peagle outputs (under ``PEAGLE_HOME/wandb``
unless ``WANDB_DIR`` is set); wandb's settings, login and caches stay where wandb keeps them.
"""

from __future__ import annotations

import os
from pathlib import Path

from peagle.config import WandbConfig
from peagle.paths import peagle_home


def wandb_home() -> Path:
    """Where wandb run directories go: ``WANDB_DIR`` when the user set it, else the peagle home."""
    return Path(os.environ["WANDB_DIR"]) if os.environ.get("WANDB_DIR") else peagle_home() / "wandb"


def check_wandb_credentials(cfg: WandbConfig) -> None:
    """Online mode needs ``WANDB_API_KEY`` in the environment; fail before any work starts."""
    if cfg.enabled and cfg.mode == "online" and not os.environ.get("WANDB_API_KEY"):
        raise RuntimeError(
            "tracking.wandb.mode is 'online' but WANDB_API_KEY is not set in the environment; "
            "export WANDB_API_KEY, or set tracking.wandb.mode: offline (sync later with `wandb sync`)"
        )


class WandbMirror:
    """One wandb run receiving the same params and metrics as the MLflow parent run.

    Stage metrics are namespaced ``<stage>/<metric>`` with their own step axis
    (``<stage>/step``), so stages that each count steps from 0 do not collide.
    """

    def __init__(self, run):
        self.run = run
        self._defined: set[str] = set()  # metric names / globs already bound to a step axis

    @classmethod
    def start(cls, cfg: WandbConfig, *, name: str | None, group: str, tags: list[str], meta: dict) -> WandbMirror:
        check_wandb_credentials(cfg)
        wandb_home().mkdir(parents=True, exist_ok=True)
        import wandb

        run = wandb.init(
            project=cfg.project,
            name=name,
            group=group,
            tags=tags,
            config=meta,
            mode=cfg.mode,
            dir=str(wandb_home()),
            reinit="create_new",
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
        )
        return cls(run)

    @property
    def run_path(self) -> str:
        return f"{self.run.project}/{self.run.id}" if self.run.project else self.run.id

    @property
    def run_dir(self) -> Path:
        """The local run directory (``.../wandb/offline-run-<time>-<id>``)."""
        return Path(self.run.dir).parent

    def log_params(self, flat: dict[str, str]) -> None:
        self.run.config.update(flat, allow_val_change=True)

    def log_metrics(self, metrics: dict[str, float], step: int | None, namespace: str = "") -> None:
        payload = {f"{namespace}{k}": v for k, v in metrics.items()}
        if step is not None:
            axis = f"{namespace}step"
            # a stage binds its whole namespace; the parent run binds each of its metrics
            for name in [f"{namespace}*"] if namespace else list(payload):
                if name not in self._defined:
                    self.run.define_metric(name, step_metric=axis)
                    self._defined.add(name)
            payload[axis] = step
        self.run.log(payload)

    def finish(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)
