"""Scheduled retraining's two decisions: whether to train a new head, and whether it replaces the champion.

Retrain when the inputs a head would be trained on now (``peagle.lineage.lineage``) differ
from the champion's recorded lineage, and no version already registered (a challenger the
gate refused, say) was trained on exactly them. Bookkeeping and where training starts
(a warm start) are not inputs.

Promote on a comparison made in one evaluation run: the evaluate stage downloads the
current champion and serves it beside the new head (same prompts, K, vLLM settings and
hardware); the gate (``promote_if_better``, its decision alone ``decide_promotion``) compares
the two scores measured there. The champion's score stored from its own run stays on its version as
history, never the basis of a comparison.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from peagle.catalogue import BASELINE, DEFAULT_METHOD
from peagle.config import PipelineConfig, with_overrides
from peagle.contract import drafts_in_parallel
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
    from peagle.publish.pull import download_version, verify_head_files
    from peagle.publish.registry import TAG_CONTENT, TAG_FILES, champion_version, head_content_digest
    from peagle.tracking.mlflow_run import read_client, registered_model_name, resolve_tracking_uri

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
    return DEFAULT_METHOD if drafts_in_parallel(head_dir) else BASELINE


def head_score(cfg: PipelineConfig, online, label: str) -> float:
    """Weighted acceptance length of the head labelled ``label`` in ``online`` at the largest
    evaluated K over the configured benchmarks (0 when it has no rows)."""
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
        return with_overrides(cfg, {"workdir": str(workdir)})


def plan_retraining(cfg: PipelineConfig, target, *, force: bool = False) -> RetrainPlan:
    """Compare the current inputs with the registry's champion (and every version trained on
    them); ``force`` retrains regardless. ``target``: a ``peagle.stages.TargetInfo``."""
    from peagle.publish.registry import TAG_REASON, champion_and_match

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


# ----------------------------------------------------------------------------- whether to promote


@dataclass(frozen=True)
class PromotionDecision:
    promoted: bool
    reason: str
    champion_before: str | None  # version numbers as MLflow reports them ("3")
    champion_after: str | None


def weighted_score(acceptance_by_benchmark: dict[str, float], weights: dict[str, float]) -> float:
    """Weighted mean acceptance over the weighted benchmarks (unweighted ones are ignored).

    A weighted benchmark without a measurement is an error: scoring it as 0 would quietly
    make a head look worse, scoring it as absent would make it look better.
    """
    if not weights or any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
        raise ValueError(f"tracking.benchmark_weights {weights} must be non-negative with a positive sum")
    missing = [b for b, w in weights.items() if w > 0 and b not in acceptance_by_benchmark]
    if missing:
        raise ValueError(
            f"no acceptance measured for weighted benchmark(s) {missing} "
            f"(measured: {sorted(acceptance_by_benchmark)}); evaluate them or drop their weights"
        )
    total = sum(w for w in weights.values() if w > 0)
    return sum(w * float(acceptance_by_benchmark[b]) for b, w in weights.items() if w > 0) / total


def decide_promotion(champion: str | None, champion_stored_score: str | None, version: str, score: float,
                     margin: float, validated: bool, measured: Mapping[str, float]) -> tuple[bool, str]:
    """(promote?, why): the gate's decision alone, from the champion's version (None: no champion)
    and its stored score (history, never compared), the head's ``score`` and the champion scores
    ``measured`` in the head's own evaluation run."""
    if not validated:
        return False, "refused: the head did not pass validation"
    if champion is None:
        return True, f"promoted: first validated head (score {score:.4f}), no champion yet"
    if champion == version:
        return False, f"version {version} is already the champion"
    stored = champion_stored_score
    history = f"; its stored score from its own run, {float(stored):.4f}, is history" if stored else ""
    if champion not in measured:
        return False, (
            f"refused: champion v{champion} was not measured in this evaluation run{history}. "
            "The gate compares heads measured together (same prompts, K, vLLM and hardware): run the "
            "evaluate stage again, which serves the champion beside the head"
        )
    champion_score = measured[champion]
    needed = champion_score * (1 + margin)
    comparison = (f"score {score:.4f} vs champion v{champion} {champion_score:.4f} measured in the same "
                  f"run, x (1 + margin {margin:g}) = {needed:.4f}{history}")
    if score > needed:
        return True, f"promoted: {comparison}"
    return False, f"refused: {comparison} (must be strictly greater)"


def promote_if_better(
    client,
    name: str,
    version: str | int,
    score: float,
    margin: float,
    validated: bool,
    *,
    measured: Mapping[str, float] | None = None,
) -> PromotionDecision:
    """Move ``champion`` to ``version`` only if it is validated and its score beats the
    champion's by ``margin`` (relative): ``score > champion_score * (1 + margin)``.

    ``measured`` maps champion versions to their scores measured in the same evaluation run
    as ``score`` (``peagle.publish.gate.measured_champions``); a champion not measured there
    is not compared with: its stored score came from another run (other prompts, K or hardware).
    ``client``: an ``MlflowClient`` or a ``Tracker``. The decision is ``decide_promotion``'s; this
    writes it on the version (tags) and moves the alias.
    """
    from peagle.publish.registry import (
        CHAMPION,
        TAG_CHAMPION_BEFORE,
        TAG_CHAMPION_SCORE,
        TAG_DECIDED_AT,
        TAG_DECISION,
        TAG_MARGIN,
        TAG_REASON,
        TAG_SCORE,
        TAG_SUPERSEDED_BY,
        TAG_VALIDATED,
        champion_version,
        client_of,
    )

    client = client_of(client)
    version = str(version)
    measured = {str(v): float(s) for v, s in (measured or {}).items()}
    if not all(math.isfinite(s) and s >= 0 for s in (score, *measured.values())):
        raise ValueError(f"scores must be finite acceptances >= 0, got {score} and {measured}")
    if margin < 0:
        raise ValueError(f"promotion margin must be >= 0, got {margin}")
    client.get_model_version(name, version)  # a clear error for an unknown version
    champion = champion_version(client, name)
    before = str(champion.version) if champion else None
    promoted, reason = decide_promotion(before, champion.tags.get(TAG_SCORE) if champion else None, version, score,
                                        margin, validated, measured)

    client.set_model_version_tag(name, version, TAG_SCORE, repr(float(score)))
    client.set_model_version_tag(name, version, TAG_VALIDATED, str(bool(validated)).lower())
    if before in measured:
        client.set_model_version_tag(name, version, TAG_CHAMPION_SCORE, repr(measured[before]))
    if promoted:
        client.set_registered_model_alias(name, CHAMPION, version)
        if before:
            client.set_model_version_tag(name, before, TAG_SUPERSEDED_BY, version)
    for key, value in {
        TAG_DECISION: "promoted" if promoted else "refused",
        TAG_REASON: reason,
        TAG_CHAMPION_BEFORE: before or "none",
        TAG_MARGIN: repr(float(margin)),
        TAG_DECIDED_AT: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }.items():
        client.set_model_version_tag(name, version, key, value)
    return PromotionDecision(promoted, reason, before, version if promoted else before)
