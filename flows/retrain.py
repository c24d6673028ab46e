"""Scheduled retraining: retrain only when something the champion was trained on changed.

1. compare the current inputs (prompt-file hashes, target revision, data and training config
   hashes) with the lineage tags on the registry's champion;
2. nothing changed: stop (no engine, no training) and say so in a Prefect artifact;
3. otherwise extend the shared dataset (the data stage regenerates and extracts only the
   samples it does not hold yet), train a new revision in its own directory
   (``<run>/revisions/<lineage key>``), evaluate it in vLLM and register it; the registry
   gate promotes it only when it beats the champion.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefect import flow, get_run_logger

from flows.common import artifact_key, run_logs, run_namer
from flows.pipeline import PipelineResult, run_pipeline
from flows.stages import resolve_target
from peagle import lineage as lineages
from peagle.config import INIT_FROM_CHAMPION, ConfigError, PipelineConfig, load_config


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
    target = resolve_target(cfg)
    current = lineages.lineage(cfg, target)
    champion, recorded, already = lineages.registry_state(cfg, current)
    before = str(champion.version) if champion else None
    changes = ["no champion yet"] if champion is None else lineages.changes_since(recorded, current)
    if already is not None and not force:  # e.g. a challenger the gate refused: retraining would repeat it
        changes = []
    if force and not changes:
        changes = ["forced"]
    if not changes:
        trained = (f"champion v{before}" if already is None or str(already.version) == before
                   else f"v{already.version} ({already.tags.get('peagle.promotion.reason', 'not promoted')})")
        message = (f"nothing new: {trained} was trained on these inputs (same prompt files, target revision "
                   f"{current['target_revision']}, same config); no data generated, nothing trained")
        log.info(message)
        create_markdown_artifact(f"### Retraining {cfg.name}\n\n{message}", key=artifact_key(cfg.name, "retrain"))
        return RetrainResult(False, [], before, None, message)

    log.info("retraining %s: %s", cfg.name, "; ".join(changes))
    data_rebuild = bool(recorded) and recorded.get("data_config_hash") != current["data_config_hash"]
    try:
        result = run_pipeline(lineages.revision_config(cfg, current), data_cfg=cfg, force_data=data_rebuild)
    except ConfigError as err:
        raise ConfigError(f"retraining {cfg.name}: {err}") from None
    decision = result.promotion
    message = (f"retrained on: {'; '.join(changes)}. Version {result.model_version}: {decision.reason}")
    create_markdown_artifact(f"### Retraining {cfg.name}\n\n{message}", key=artifact_key(cfg.name, "retrain"))
    log.info(message)
    return RetrainResult(True, changes, before, result, message)
