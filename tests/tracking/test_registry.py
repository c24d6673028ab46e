"""The registry gate: challenger on registration, champion only for a validated, better head."""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path

import pytest

from peagle.layout import LINEAGE_FILE
from peagle.lineage import recorded_lineage
from peagle.publish.gate import decide_promotion, promote_if_better, weighted_score
from peagle.publish.pull import download_champion
from peagle.publish.registry import (
    CHALLENGER,
    CHAMPION,
    MAX_DESCRIPTION_CHARS,
    TAG_CHAMPION_SCORE,
    TAG_DECISION,
    TAG_SCORE,
    TAG_SUPERSEDED_BY,
    card_description,
    champion_and_match,
    describe_with_card,
    head_content_digest,
    register_head,
    registered_twin,
    tag_head_content,
)
from peagle.tracking.mlflow_run import Tracker

_names = itertools.count()


@pytest.fixture(scope="module")
def tracker(tracking):
    """One pipeline run holding every head these tests register."""
    with Tracker(tracking, "registry-tests") as tracker:
        yield tracker


@pytest.fixture()
def model_name(request):
    return f"peagle-test-{request.node.name}-{next(_names)}".replace("[", "-").replace("]", "")


@pytest.fixture()
def register(tracker, tmp_path, make_head_dir):
    """Register a fresh head (seeded contents) as a new version of ``name``."""
    def _register(name, seed, validated=True):
        head = make_head_dir(tmp_path / f"{name}-head-{seed}", seed=seed)
        return register_head(tracker, tracker.run_id, head, name,
                             tags={"target": "registry-tests", "k": 5, "validated": validated},
                             metrics={"acceptance_k5": 0.5 + seed / 100})
    return _register


def aliases(tracker, name) -> dict[str, str]:
    return {alias: str(v) for alias, v in tracker.client.get_registered_model(name).aliases.items()}


def test_register_uploads_head_and_names_it_challenger(tracker, register, tmp_path, model_name):
    version = register(model_name, seed=1)
    assert version.source.endswith(f"heads/{model_name}-head-1") and version.run_id == tracker.run_id
    assert version.tags["k"] == "5" and version.tags["metric.acceptance_k5"] == "0.51"
    files = json.loads(version.tags["peagle.files"])
    assert set(files) == {"config.json", "model.safetensors", "README.md"}
    assert aliases(tracker, model_name) == {CHALLENGER: str(version.version)}


def test_first_validated_head_becomes_champion(tracker, register, tmp_path, model_name):
    v1 = register(model_name, seed=1)
    decision = promote_if_better(tracker, model_name, v1.version, score=0.5, margin=0.05, validated=True)
    assert decision.promoted and decision.champion_before is None and decision.champion_after == str(v1.version)
    assert aliases(tracker, model_name)[CHAMPION] == str(v1.version)
    tags = tracker.client.get_model_version(model_name, v1.version).tags
    assert tags[TAG_DECISION] == "promoted" and float(tags[TAG_SCORE]) == 0.5


@pytest.mark.parametrize(
    ("score", "validated", "promoted"),
    [
        (0.40, True, False),  # worse: stays challenger
        (0.52, True, False),  # better, but by less than the 5% margin (needs > 0.525)
        (0.90, False, False),  # far better but not validated
        (0.53, True, True),  # better by more than the margin
    ],
)
def test_gate_moves_champion_only_for_validated_margin_beaters(tracker, register, model_name, score, validated, promoted):
    v1 = register(model_name, seed=1)
    promote_if_better(tracker, model_name, v1.version, score=0.5, margin=0.05, validated=True)
    v2 = register(model_name, seed=2, validated=validated)

    decision = promote_if_better(tracker, model_name, v2.version, score=score, margin=0.05, validated=validated,
                                 measured={v1.version: 0.5})

    assert decision.promoted is promoted
    assert decision.champion_before == str(v1.version)
    assert decision.champion_after == str(v2.version if promoted else v1.version)
    assert aliases(tracker, model_name) == {CHAMPION: decision.champion_after, CHALLENGER: str(v2.version)}
    tags = tracker.client.get_model_version(model_name, v2.version).tags
    assert tags[TAG_DECISION] == ("promoted" if promoted else "refused")
    assert tags["peagle.promotion.reason"] == decision.reason
    assert ("validation" in decision.reason) is (not validated)
    old = tracker.client.get_model_version(model_name, v1.version).tags
    assert (old.get(TAG_SUPERSEDED_BY) == str(v2.version)) is promoted


def test_the_gate_compares_with_the_champion_measured_in_the_same_run(tracker, register, model_name):
    """v1's stored score came from its own run (other hardware, say); only the same-run score counts."""
    v1 = register(model_name, seed=1)
    promote_if_better(tracker, model_name, v1.version, score=0.9, margin=0.05, validated=True)
    v2 = register(model_name, seed=2)

    decision = promote_if_better(tracker, model_name, v2.version, score=0.6, margin=0.05, validated=True,
                                 measured={v1.version: 0.5})

    assert decision.promoted, decision.reason
    assert f"champion v{v1.version} 0.5000 measured in the same run" in decision.reason
    assert "stored score from its own run, 0.9000, is history" in decision.reason
    assert float(tracker.client.get_model_version(model_name, v2.version).tags[TAG_CHAMPION_SCORE]) == 0.5
    assert float(tracker.client.get_model_version(model_name, v1.version).tags[TAG_SCORE]) == 0.9  # history kept


@pytest.mark.parametrize("measured", [None, {"99": 0.1}], ids=["nothing-measured", "another-version-measured"])
def test_a_champion_not_measured_beside_the_head_is_not_compared_with(tracker, register, model_name, measured):
    v1 = register(model_name, seed=1)
    promote_if_better(tracker, model_name, v1.version, score=0.1, margin=0.0, validated=True)
    v2 = register(model_name, seed=2)

    decision = promote_if_better(tracker, model_name, v2.version, score=3.0, margin=0.0, validated=True,
                                 measured=measured)

    assert not decision.promoted and decision.champion_after == str(v1.version)
    assert f"champion v{v1.version} was not measured in this evaluation run" in decision.reason
    assert "run the evaluate stage again" in decision.reason
    assert TAG_CHAMPION_SCORE not in tracker.client.get_model_version(model_name, v2.version).tags


def test_the_heads_lineage_file_becomes_version_tags(tracker, tmp_path, make_head_dir, model_name):
    head = make_head_dir(tmp_path / f"{model_name}-head", seed=5)  # its own artifact path in the shared run
    lineage = {"target_revision": "local:abc", "train_config_hash": "t1", "prompt_files": '{"p.jsonl": "h"}'}
    (head / LINEAGE_FILE).write_text(json.dumps(lineage))
    version = register_head(tracker, tracker.run_id, head, model_name, tags={}, metrics={})
    assert recorded_lineage(version) == lineage
    assert LINEAGE_FILE in json.loads(version.tags["peagle.files"])  # shipped with the head, verified on download


def test_download_champion_gives_the_registered_files(tracker, register, tmp_path, model_name):
    with pytest.raises(LookupError, match="no champion"):
        download_champion(tracker, model_name, tmp_path / "none")
    v1 = register(model_name, seed=3)
    with pytest.raises(LookupError, match="no champion"):  # a challenger alone is not served
        download_champion(tracker, model_name, tmp_path / "none")
    promote_if_better(tracker, model_name, v1.version, score=0.5, margin=0.0, validated=True)
    register(model_name, seed=4)  # a newer challenger must not be what we get

    head = download_champion(tracker, model_name, tmp_path / "serve" / "head")

    source = tmp_path / f"{model_name}-head-3"
    assert sorted(p.name for p in head.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    for name in ("config.json", "model.safetensors"):
        assert hashlib.sha256((head / name).read_bytes()).digest() == hashlib.sha256((source / name).read_bytes()).digest()
    assert not [p for p in head.parent.iterdir() if p.name.startswith(".")]  # no staging left behind
    with pytest.raises(FileExistsError):
        download_champion(tracker, model_name, head)


def test_download_refuses_a_corrupted_champion(tracker, register, tmp_path, model_name):
    v1 = register(model_name, seed=5)
    promote_if_better(tracker, model_name, v1.version, score=0.5, margin=0.0, validated=True)
    stored = Path(v1.source.removeprefix("file://")) / "model.safetensors"
    stored.write_bytes(stored.read_bytes()[:-16])  # a truncated upload

    with pytest.raises(ValueError, match="incomplete or corrupt"):
        download_champion(tracker, model_name, tmp_path / "serve")
    assert not (tmp_path / "serve").exists()


def test_register_rejects_incomplete_heads_and_reused_paths(tracker, register, tmp_path, model_name, make_head_dir):
    head = make_head_dir(tmp_path / "partial", seed=6)
    (head / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        register_head(tracker, tracker.run_id, head, model_name, tags={}, metrics={})
    register(model_name, seed=7)
    with pytest.raises(FileExistsError):
        register_head(tracker, tracker.run_id, tmp_path / f"{model_name}-head-7", model_name, tags={}, metrics={})


def test_weighted_score():
    assert weighted_score({"code": 0.6, "chat": 0.4, "math": 0.1}, {"code": 3.0, "chat": 1.0}) == pytest.approx(0.55)
    with pytest.raises(ValueError, match="math"):
        weighted_score({"code": 0.6}, {"code": 1.0, "math": 1.0})
    with pytest.raises(ValueError, match="positive sum"):
        weighted_score({"code": 0.6}, {"code": 0.0})


def test_content_digest_ignores_the_card_and_sees_every_tensor(tmp_path, make_head_dir):
    a = make_head_dir(tmp_path / "a", seed=1)
    b = make_head_dir(tmp_path / "b", seed=1)
    (b / "README.md").write_text("# another card\n")
    assert head_content_digest(a) == head_content_digest(b)
    assert head_content_digest(a) != head_content_digest(make_head_dir(tmp_path / "c", seed=2))


def test_a_republished_head_finds_its_registered_twin(tracker, register, tmp_path, make_head_dir, model_name):
    assert registered_twin(tracker, model_name, make_head_dir(tmp_path / "none", seed=3)) is None  # no model yet
    v1 = register(model_name, seed=3)
    tag_head_content(tracker, model_name, v1.version, tmp_path / f"{model_name}-head-3")
    again = make_head_dir(tmp_path / "again", seed=3)  # a second export of the same weights
    assert registered_twin(tracker, model_name, again).version == v1.version
    assert registered_twin(tracker, model_name, make_head_dir(tmp_path / "other", seed=4)) is None


def test_champion_and_the_newest_version_trained_on_the_same_inputs(tracking, tracker, register, model_name):
    named = tracking.model_copy(update={"registered_model": model_name})
    assert champion_and_match(named, "any-target", lambda v: True) == (None, None)  # no model yet
    v1, v2, _ = (register(model_name, seed=s) for s in (1, 2, 3))
    assert champion_and_match(named, "any-target", lambda v: True) == (None, None)  # nothing promoted yet
    promote_if_better(tracker, model_name, v1.version, score=0.5, margin=0.05, validated=True)
    champion, match = champion_and_match(named, "any-target", lambda v: v.version in (v1.version, v2.version))
    assert (champion.version, match.version) == (v1.version, v2.version)
    assert champion_and_match(named, "any-target", lambda v: False) == (champion, None)


CARD = """---
license: apache-2.0
library_name: vllm
---

# peagle-demo

A P-EAGLE head.

| K | P-EAGLE |
|---|---|
| 3 | 2.10 |
"""


def test_the_model_card_is_the_version_description(tracker, tmp_path, make_head_dir, model_name):
    head = make_head_dir(tmp_path / "carded", seed=8)
    (head / "README.md").write_text(CARD)
    version = register_head(tracker, tracker.run_id, head, model_name, tags={}, metrics={})

    shown = tracker.client.get_model_version(model_name, version.version).description
    assert shown.startswith("# peagle-demo\n") and "| 3 | 2.10 |" in shown  # Markdown, front matter off
    assert "license:" not in shown
    # a version without one (registered by an older peagle) gets its registered card, once
    tracker.client.update_model_version(model_name, version.version, description="")
    assert describe_with_card(tracker, model_name, version.version)
    assert tracker.client.get_model_version(model_name, version.version).description == shown
    tracker.client.update_model_version(model_name, version.version, description="curated by hand")
    assert not describe_with_card(tracker, model_name, version.version)  # a written description stays


def test_a_card_longer_than_mlflow_keeps_says_where_the_rest_is():
    text = card_description(CARD + "x" * 10_000)
    assert len(text) <= MAX_DESCRIPTION_CHARS and text.rstrip().endswith("in the version's files)")


def test_the_gate_refuses_a_sqlite_store_that_does_not_exist(tmp_path, make_head_dir):
    from peagle.config import load_config
    from peagle.publish.gate import champion_to_measure
    from peagle.tracking.mlflow_run import TrackingStoreMissing

    missing = tmp_path / "mlflow.db"
    cfg = load_config("configs/tiny.yaml", {"workdir": str(tmp_path / "run"), "tracking.tracking_uri": f"sqlite:///{missing}"})
    with pytest.raises(TrackingStoreMissing, match=f"no database at {missing}"):
        champion_to_measure(cfg, make_head_dir(tmp_path / "head"))
    assert not missing.exists()


def test_the_gates_decision_is_a_pure_function_of_what_was_measured():
    """No registry needed: the decision reads the champion's version, its stored score (history)
    and the scores measured in the head's own evaluation run."""
    assert decide_promotion(None, None, "1", 0.5, 0.0, True, {}) == (
        True, "promoted: first validated head (score 0.5000), no champion yet")
    assert decide_promotion(None, None, "1", 0.5, 0.0, False, {})[0] is False
    assert decide_promotion("1", "9.0", "1", 0.5, 0.0, True, {"1": 0.1})[1] == "version 1 is already the champion"
    refused, why = decide_promotion("1", "0.1", "2", 5.0, 0.0, True, {})
    assert not refused and "not measured in this evaluation run" in why and "is history" in why
    assert decide_promotion("1", "9.0", "2", 1.1, 0.05, True, {"1": 1.0})[0]  # 1.1 > 1.0 x 1.05: history ignored
    assert not decide_promotion("1", None, "2", 1.05, 0.05, True, {"1": 1.0})[0]  # strictly greater
