"""The whole pipeline as one Prefect flow composing the stage flows as subflows:
target -> data -> train (+ offline eval + export) -> evaluate -> publish.

This module only wires the stage flows of ``flows.stages`` together and opens the MLflow
run (with a nested run per stage) that they report into. The data, training and online
evaluation results are cached on their inputs, so a rerun with nothing changed reuses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefect import flow

from flows.common import (
    ensure_accelerator_limit,
    publish_mlflow_artifact,
    run_logger,
    run_logs,
    run_namer,
)
from flows.stages import data_flow, evaluate_flow, publish_flow, resolve_target, run_export, train_flow
from peagle import stages
from peagle.catalogue import trained_methods
from peagle.config import PipelineConfig, load_config, write_resolved_config
from peagle.layout import RunLayout
from peagle.lineage import dataset_prompt_files, read_head_lineage
from peagle.publish import records


@dataclass
class PipelineResult:
    config_name: str
    target_path: str
    data_dir: str
    head_dir: str
    checkpoint_dir: str
    online: object
    offline: object
    stage_seconds: dict = field(default_factory=dict)
    mlflow_run_id: str | None = None
    mlflow_run_url: str | None = None
    model_version: str | None = None
    promotion: object = None
    plot: str | None = None
    lineage: dict = field(default_factory=dict)  # what the head was trained on (its lineage.json)


@flow(name="peagle-pipeline", flow_run_name=run_namer("pipeline", config_param="config_path"))
def pipeline_flow(config_path: str = "configs/demo.yaml", overrides: dict | None = None) -> PipelineResult:
    """Run every stage on one config; returns paths, measured acceptance and the MLflow run."""
    return run_pipeline(load_config(config_path, overrides))


def run_pipeline(cfg: PipelineConfig, *, data_cfg: PipelineConfig | None = None, force_data: bool = False) -> PipelineResult:
    """The stages in order under one MLflow run. ``data_cfg`` (default ``cfg``) says where the
    dataset lives: retraining trains a new revision directory on the shared dataset."""
    data_cfg = data_cfg or cfg
    with run_logs(cfg) as library_log:
        run_logger().info("library output (vLLM, DeepSpeed, torch) goes to %s", library_log)
        ensure_accelerator_limit(cfg)
        stages.check_training_runs_here(cfg)
        return _run_stages(cfg, data_cfg, force_data)


def _run_stages(cfg: PipelineConfig, data_cfg: PipelineConfig, force_data: bool) -> PipelineResult:
    from peagle.export.card import write_run_card  # imports torch: not at flow import
    from peagle.tracking.mlflow_run import Tracker

    method, *baseline = trained_methods(cfg.train)  # the head, then the EAGLE-3 baseline when asked for
    # Subflows get the resolved config's path, not the config: Prefect stores parameters.
    config, data_config = str(write_resolved_config(cfg)), str(write_resolved_config(data_cfg))
    timer = stages.StageTimer()
    with Tracker(cfg.tracking, target_id=cfg.target.model, config=cfg) as tracker:
        with timer.stage("target"), tracker.stage("target"):
            target = resolve_target(cfg)
        with timer.stage("data"), tracker.stage("data") as run:
            data = data_flow(data_config, force=force_data, target=target)
            datasets = records.record_dataset(tracker, run, data, dataset_prompt_files(data.data_dir))
        with timer.stage("train"), tracker.stage("train", system_metrics=True) as run:
            records.record_training_inputs(run, datasets)
            trained = train_flow(config, str(data.data_dir), target=target, export=False, mlflow_run_id=run.run_id)
            records.record_training(run, trained)
            records.record_offline(run, trained.offline)
        with timer.stage("export"), tracker.stage("export"):
            head_dir = str(run_export(cfg, target, str(data.data_dir), trained.best_checkpoint, method.name))
        head_key, baseline_dir = trained.cache_key, None
        for other in baseline:  # the same data, trained autoregressively: the comparison users ask for
            with timer.stage(f"train_{other.name}"), tracker.stage(f"train-{other.name}", system_metrics=True) as run:
                records.record_training_inputs(run, datasets)
                compared = train_flow(config, str(data.data_dir), target=target, method=other.name,
                                      mlflow_run_id=run.run_id)
                records.record_training(run, compared)
                records.record_offline(run, compared.offline)
            baseline_dir, head_key = compared.head_dir, f"{head_key}+{compared.cache_key}"
        with timer.stage("evaluate"), tracker.stage("evaluate") as run:
            online = evaluate_flow(config, head_dir, target=target, head_key=head_key, baseline_dir=baseline_dir)
            plot = records.record_online(run, online, RunLayout(cfg.run_dir).eval)
            write_run_card(head_dir, cfg, data, online, trained.offline, trained.best_checkpoint)
            for other in baseline:
                write_run_card(baseline_dir, cfg, data, online, compared.offline, compared.best_checkpoint,
                               method=other.name)
        with timer.stage("publish"), tracker.stage("publish"):
            published = publish_flow(config, head_dir, str(RunLayout(cfg.run_dir).online_results),
                                     mlflow_run_id=tracker.run_id)
        tracker.log_metrics({f"seconds_{name}": s for name, s in timer.seconds.items()})
        publish_mlflow_artifact(tracker.run_url(), tracker.run_id, cfg.name)
        return PipelineResult(
            config_name=cfg.name,
            target_path=target.path,
            data_dir=str(data.data_dir),
            head_dir=str(head_dir),
            checkpoint_dir=str(trained.best_checkpoint),
            online=online,
            offline=trained.offline,
            stage_seconds=timer.seconds,
            mlflow_run_id=tracker.run_id,
            mlflow_run_url=tracker.run_url(),
            model_version=published.version,
            promotion=published.promotion,
            plot=str(plot),
            lineage=read_head_lineage(head_dir),
        )
