"""Registering a pipeline run's head: its promotion score, the serving check, the registry gate.

The head's lineage travels in its own ``lineage.json`` (``register_head`` tags it); the gate
compares it with the champion measured in the same evaluation run (``peagle.publish.gate``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from peagle.catalogue import describe
from peagle.config import PipelineConfig


def drafted(online, label: str) -> bool:
    """The head loaded in vLLM and proposed draft tokens at every K (the serving check)."""
    rows = [r for r in online.rows if r.method == label]
    return bool(rows) and all(r.num_draft_tokens > 0 for r in rows)


def promotion_score(cfg: PipelineConfig, online) -> float:
    """Weighted acceptance length of the ``train.method`` head at the largest evaluated K over
    the configured benchmarks."""
    from peagle.publish.gate import head_score

    return head_score(cfg, online, describe(cfg.train.method).label)


def publish_head(cfg: PipelineConfig, tracker, head_dir: Path, online, *, validated: bool):
    """Register the ``train.method`` head as a model version (alias challenger); promote it only if
    it beats the champion measured in the same evaluation run (``online``)."""
    from peagle.publish.gate import measured_champions, promote_if_better
    from peagle.publish.registry import TAG_TARGET, register_head
    from peagle.tracking.mlflow_run import registered_model_name

    method = describe(cfg.train.method)
    name = registered_model_name(cfg.tracking, cfg.target.model)
    score = promotion_score(cfg, online)
    acceptance = online.acceptance_by_k(method.label)
    version = register_head(
        tracker, tracker.run_id, head_dir, name,
        tags={TAG_TARGET: cfg.target.model, "K": str(max(cfg.eval.ks)), "validated": str(validated),
              "method": method.label, "config": cfg.name},
        metrics={"score": score, **{f"acceptance_length_k{k}": v for k, v in acceptance.items()}},
    )
    decision = promote_if_better(tracker, name, version.version, score, cfg.tracking.promotion_margin, validated,
                                 measured=measured_champions(cfg, online))
    return version, decision


@dataclass
class PublishOutcome:
    version: str
    promotion: object  # peagle.publish.gate.PromotionDecision
    reused: bool  # an identical head was already registered: nothing new registered


def publish_once(cfg: PipelineConfig, tracker, head_dir: Path, online, *, validated: bool) -> PublishOutcome:
    """Register and gate the head unless an identical one (same files) is registered already;
    a new version carries its lineage (its ``lineage.json``: what retraining compares) and its
    content hash."""
    from peagle.publish.gate import PromotionDecision
    from peagle.publish.registry import (
        champion_version,
        describe_with_card,
        registered_twin,
        tag_head_content,
    )
    from peagle.tracking.mlflow_run import registered_model_name

    name = registered_model_name(cfg.tracking, cfg.target.model)
    twin = registered_twin(tracker, name, Path(head_dir))
    if twin is not None:
        describe_with_card(tracker, name, twin.version)
        champion = champion_version(tracker, name)
        before = str(champion.version) if champion else None
        reason = f"identical head already registered as version {twin.version}; nothing registered"
        return PublishOutcome(str(twin.version), PromotionDecision(False, reason, before, before), True)
    version, decision = publish_head(cfg, tracker, Path(head_dir), online, validated=validated)
    tag_head_content(tracker, name, version.version, Path(head_dir))
    return PublishOutcome(str(version.version), decision, False)
