"""The whole pipeline as one Prefect flow: target -> data -> train -> export -> evaluate -> publish.

Each task calls one stage function of ``peagle.pipeline``; this module only wires them
together and opens the MLflow run (with a nested run per stage) that they report into.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from peagle import pipeline as stages
from peagle.config import PipelineConfig, load_config
from peagle.paths import configure_environment


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


@task(name="target", cache_policy=NO_CACHE)
def target_task(cfg: PipelineConfig) -> stages.TargetInfo:
    return stages.prepare_target(cfg)


@task(name="data", cache_policy=NO_CACHE)
def data_task(cfg: PipelineConfig, target: stages.TargetInfo):
    return stages.generate_data(cfg, target)


@task(name="train", cache_policy=NO_CACHE)
def train_task(cfg: PipelineConfig, target: stages.TargetInfo, data_dir: Path):
    return stages.train_head(cfg, target, data_dir)


@task(name="evaluate-offline", cache_policy=NO_CACHE)
def offline_task(cfg: PipelineConfig, target: stages.TargetInfo, data_dir: Path, checkpoint: Path):
    return stages.evaluate_offline(cfg, target, data_dir, checkpoint)


@task(name="export", cache_policy=NO_CACHE)
def export_task(cfg: PipelineConfig, target: stages.TargetInfo, data_dir: Path, checkpoint: Path):
    return stages.export_head(cfg, target, data_dir, checkpoint)


@task(name="evaluate-online", cache_policy=NO_CACHE)
def online_task(cfg: PipelineConfig, target: stages.TargetInfo, heads: dict[str, Path]):
    return stages.evaluate_online(cfg, target, heads)


@task(name="publish", cache_policy=NO_CACHE)
def publish_task(cfg: PipelineConfig, tracker, head_dir: Path, online, validated: bool):
    return stages.publish_head(cfg, tracker, head_dir, online, validated=validated)


@flow(name="peagle-pipeline")
def pipeline_flow(config_path: str = "configs/demo.yaml", overrides: dict | None = None) -> PipelineResult:
    """Run every stage on one config; returns paths, measured acceptance and the MLflow run."""
    configure_environment()
    return run_pipeline(load_config(config_path, overrides))


def run_pipeline(cfg: PipelineConfig) -> PipelineResult:
    from peagle.tracking import Tracker

    timer = stages.StageTimer()
    with Tracker(cfg.tracking, target_id=cfg.target.model, config=cfg) as tracker:
        with timer.stage("target"), tracker.stage("target"):
            target = target_task(cfg)
        with timer.stage("data"), tracker.stage("data") as run:
            data = data_task(cfg, target)
            stages.record_dataset(tracker, run, data)
        with timer.stage("train"), tracker.stage("train") as run:
            trained = train_task(cfg, target, data.data_dir)
            stages.record_training(run, trained)
            offline = offline_task(cfg, target, data.data_dir, trained.best_checkpoint)
            stages.record_offline(run, offline)
        with timer.stage("export"), tracker.stage("export"):
            head_dir = export_task(cfg, target, data.data_dir, trained.best_checkpoint)
        with timer.stage("evaluate"), tracker.stage("evaluate") as run:
            online = online_task(cfg, target, {stages.PEAGLE_LABEL: head_dir})
            plot = stages.record_online(run, online, cfg.run_dir / "eval")
            stages.write_card(head_dir, stages.model_card(cfg, target, data, online, offline), data)
        with timer.stage("publish"), tracker.stage("publish"):
            version, decision = publish_task(cfg, tracker, head_dir, online, stages.drafted(online, stages.PEAGLE_LABEL))
        tracker.log_metrics({f"seconds_{name}": s for name, s in timer.seconds.items()})
        return PipelineResult(
            config_name=cfg.name,
            target_path=target.path,
            data_dir=str(data.data_dir),
            head_dir=str(head_dir),
            checkpoint_dir=str(trained.best_checkpoint),
            online=online,
            offline=offline,
            stage_seconds=timer.seconds,
            mlflow_run_id=tracker.run_id,
            mlflow_run_url=tracker.run_url(),
            model_version=str(version.version),
            promotion=decision,
            plot=str(plot),
        )
