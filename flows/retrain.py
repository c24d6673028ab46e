"""Scheduled retraining: retrain only when something the champion was trained on changed.

1. compare the current inputs (prompt-file hashes, the target's hub commit or content hash,
   data and training config hashes) with the lineage tags on the registry's champion and
   its siblings (``peagle.publish.gate.plan_retraining``);
2. nothing changed: stop (no engine, no training) and say so in a Prefect artifact;
3. otherwise extend the shared dataset (the data stage regenerates and extracts only the
   samples it does not hold yet), train a new revision in its own directory
   (``<run>/revisions/<lineage key>``), evaluate it in vLLM beside the current champion and
   register it; the registry gate promotes it only when it beats the champion in that run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefect import flow, get_run_logger

from flows.common import artifact_key, run_logs, run_namer
from flows.pipeline import PipelineResult, run_pipeline
from flows.stages import resolve_target
from peagle.config import INIT_FROM_CHAMPION, ConfigError, PipelineConfig, load_config
from peagle.publish.gate import plan_retraining


@dataclass
class RetrainResult:
    retrained: bool
    changes: list[str] = field(default_factory=list)
    champion_before: str | None = None
    pipeline: PipelineResult | None = None
    message: str = ""


@flow(name="peagle-retrain", flow_run_name=run_namer("retrain", config_param="config_path"))
def retrain_flow(config_path: str = "configs/demo.yaml", overrides: dict | None = None,
                 force: bool = False, warm_start: bool = False) -> RetrainResult:
    """Retrain a custom model's head when its prompt data, target or config changed since the
    champion was trained; promote through the registry gate. ``force`` retrains regardless;
    ``warm_start`` starts from the champion's weights (``train.init_from: champion``)."""
    if warm_start:
        overrides = {**(overrides or {}), "train.init_from": INIT_FROM_CHAMPION}
    cfg = load_config(config_path, overrides)
    with run_logs(cfg):
        return _retrain(cfg, force)


def _retrain(cfg: PipelineConfig, force: bool) -> RetrainResult:
    from prefect.artifacts import create_markdown_artifact

    log = get_run_logger()
    plan = plan_retraining(cfg, resolve_target(cfg), force=force)
    log.info(plan.message)
    if not plan.retrain:
        create_markdown_artifact(f"### Retraining {cfg.name}\n\n{plan.message}", key=artifact_key(cfg.name, "retrain"))
        return RetrainResult(False, [], plan.champion, None, plan.message)

    try:
        result = run_pipeline(plan.revision_config(cfg), data_cfg=cfg, force_data=plan.rebuild_data)
    except ConfigError as err:
        raise ConfigError(f"retraining {cfg.name}: {err}") from None
    message = f"retrained on: {'; '.join(plan.changes)}. Version {result.model_version}: {result.promotion.reason}"
    create_markdown_artifact(f"### Retraining {cfg.name}\n\n{message}", key=artifact_key(cfg.name, "retrain"))
    log.info(message)
    return RetrainResult(True, plan.changes, plan.champion, result, message)
