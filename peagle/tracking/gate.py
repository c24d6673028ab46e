"""Scheduled retraining's two decisions: whether to train a new head, and whether it replaces the champion.

Retrain when the inputs a head would be trained on now (``peagle.lineage.lineage``) differ
from the champion's recorded lineage, and no version already registered (a challenger the
gate refused, say) was trained on exactly them. Bookkeeping and where training starts
(a warm start) are not inputs.

Promote on a comparison made in one evaluation run: the evaluate stage downloads the
current champion and serves it beside the new head (same prompts, K, vLLM settings and
hardware); the gate (``peagle.tracking.registry.promote_if_better``) compares the two scores
measured there. The champion's score stored from its own run stays on its version as
history, never the basis of a comparison.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from peagle.config import PipelineConfig
from peagle.layout import RunLayout
from peagle.lineage import changes_since, lineage, lineage_key, recorded_lineage

CHAMPION_LABEL = re.compile(r"^champion-v(?P<version>[0-9]+)$")  # the champion's rows in an OnlineResult


def champion_label(version: str | int) -> str:
    """How the champion's rows are labelled in the evaluation that measures it beside the head."""
    return f"champion-v{version}"


# ----------------------------------------------------------------------------- measuring the champion


@dataclass(frozen=True)
class ChampionHead:
    """The registry champion, downloaded (verified) to be served beside a new head."""

    version: str
    head_dir: str
    method: str  # the drafting method it is served as (parallel drafting only with mask_hidden)
    content: str  # its head_content_digest: part of the evaluation's cache key

    @property
    def label(self) -> str:
        return champion_label(self.version)


def champion_to_measure(cfg: PipelineConfig, challenger_dir: str | Path) -> ChampionHead | None:
    """The champion to serve beside ``challenger_dir``'s head, downloaded into the run directory;
    None when there is none yet or it is that very head (nothing to compare)."""
    from peagle.tracking.mlflow_run import read_client, registered_model_name, resolve_tracking_uri
    from peagle.tracking.pull import download_version, verify_head_files
    from peagle.tracking.registry import TAG_CONTENT, TAG_FILES, champion_version, head_content_digest

    client = read_client(resolve_tracking_uri(cfg.tracking))
    champion = champion_version(client, registered_model_name(cfg.tracking, cfg.target.model))
    if champion is None:
        return None
    challenger = head_content_digest(Path(challenger_dir))
    if champion.tags.get(TAG_CONTENT) == challenger:
        return None
    dst = RunLayout(cfg.run_dir).champion(champion.version)
    try:
        verify_head_files(dst, json.loads(champion.tags.get(TAG_FILES, "{}")))
    except (FileNotFoundError, ValueError):  # not downloaded yet, or not intact: fetch it again
        download_version(client, champion, dst, overwrite=True)
    content = head_content_digest(dst)
    if content == challenger:
        return None
    return ChampionHead(str(champion.version), str(dst), served_method(dst), content)


def served_method(head_dir: Path) -> str:
    """The method a head drafts with, read from its weights as ``peagle serve`` does."""
    from safetensors import safe_open

    from peagle.export.contract import WEIGHTS_FILE
    from peagle.methods import BASELINE, DEFAULT_METHOD
    from peagle.serving.server import MASK_HIDDEN

    with safe_open(str(Path(head_dir) / WEIGHTS_FILE), framework="numpy") as fh:
        return DEFAULT_METHOD if MASK_HIDDEN in fh.keys() else BASELINE


def head_score(cfg: PipelineConfig, online, label: str) -> float:
    """Weighted acceptance length of the head labelled ``label`` in ``online`` at the largest
    evaluated K over the configured benchmarks (0 when it has no rows)."""
    from peagle.tracking.registry import weighted_score

    acceptance = online.acceptance_by_k(label)
    value = acceptance[max(acceptance)] if acceptance else 0.0
    return weighted_score({name: value for name in cfg.tracking.benchmark_weights}, cfg.tracking.benchmark_weights)


def measured_champions(cfg: PipelineConfig, online) -> dict[str, float]:
    """Champion version -> its score measured in ``online`` (the same run as the head's)."""
    return {m["version"]: head_score(cfg, online, label)
            for label in online.methods() if (m := CHAMPION_LABEL.match(label))}


# ----------------------------------------------------------------------------- whether to retrain


@dataclass(frozen=True)
class RetrainPlan:
    retrain: bool
    changes: list[str] = field(default_factory=list)  # why (empty when not retraining)
    champion: str | None = None  # the champion's version before retraining
    current: dict[str, str] = field(default_factory=dict)  # the lineage of the current inputs
    rebuild_data: bool = False  # the target/data config changed: the shared dataset is rebuilt
    message: str = ""  # what was decided, for the logs and the Prefect artifact

    def revision_config(self, cfg: PipelineConfig) -> PipelineConfig:
        """The same config, writing checkpoints and heads under a directory named by its inputs
        (``<run>/revisions/<lineage key>``)."""
        workdir = RunLayout(cfg.run_dir).revision(lineage_key(self.current))
        return cfg.model_copy(update={"workdir": str(workdir)})


def plan_retraining(cfg: PipelineConfig, target, *, force: bool = False) -> RetrainPlan:
    """Compare the current inputs with the registry's champion (and every version trained on
    them); ``force`` retrains regardless. ``target``: a ``peagle.stages.TargetInfo``."""
    from peagle.tracking.registry import TAG_REASON, champion_and_match

    current = lineage(cfg, target)
    champion, already = champion_and_match(cfg.tracking, cfg.target.model,
                                           lambda v: not changes_since(recorded_lineage(v), current))
    before = str(champion.version) if champion else None
    recorded = recorded_lineage(champion)
    changes = ["no champion yet"] if champion is None else changes_since(recorded, current)
    if already is not None and not force:  # e.g. a challenger the gate refused: retraining would repeat it
        changes = []
    if force and not changes:
        changes = ["forced"]
    rebuild = bool(recorded) and recorded.get("data_config_hash") != current["data_config_hash"]
    if changes:
        return RetrainPlan(True, changes, before, current, rebuild, f"retraining {cfg.name}: {'; '.join(changes)}")
    trained = (f"champion v{before}" if str(already.version) == before
               else f"v{already.version} ({already.tags.get(TAG_REASON, 'not promoted')})")
    message = (f"nothing new: {trained} was trained on these inputs (same prompt files, target revision "
               f"{current['target_revision']}, same config); no data generated, nothing trained")
    return RetrainPlan(False, [], before, current, False, message)
