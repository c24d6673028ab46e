"""Scheduled retraining decides for the right reasons (``peagle.publish.gate.plan_retraining``).

Each test registers heads the way the pipeline does (``register_head`` on a head directory
whose ``lineage.json`` records what it was trained on; the first validated one promoted),
changes one thing a user might change, and asks the plan whether to retrain. The embedded
target, a real SQLite MLflow registry, no engine and no training: the full retraining run is
``tests/flows/test_flows.py``'s.
"""

from __future__ import annotations

import itertools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from peagle.config import load_config
from peagle.layout import LINEAGE_FILE
from peagle.lineage import hub_revision, lineage
from peagle.publish.gate import plan_retraining, promote_if_better
from peagle.publish.registry import register_head
from peagle.stages import TargetInfo, prepare_target, with_train
from peagle.tracking.mlflow_run import Tracker

REPO = Path(__file__).resolve().parents[2]
_models = itertools.count()
_seeds = itertools.count(100)


@dataclass
class World:
    """A user's config (its own prompt file, registry entry and run dir) and their registry."""

    tmp: Path
    overrides: dict
    make_head_dir: object

    @property
    def prompts(self) -> Path:
        return self.tmp / "prompts.jsonl"

    def cfg(self, **more):
        return load_config(REPO / "configs" / "tiny.yaml", {**self.overrides, **more})

    def register(self, cfg, target, *, promote: bool, champion_score: float | None = None,
                 recorded: dict | None = None) -> str:
        """A head trained on ``cfg``'s current inputs (or the lineage ``recorded``), registered;
        promoted when asked, else refused by the gate against the champion measured beside it
        at ``champion_score``."""
        head = self.make_head_dir(self.tmp / f"head-{next(_seeds)}", seed=next(_seeds))
        (head / LINEAGE_FILE).write_text(json.dumps(recorded or lineage(cfg, target)))
        with Tracker(cfg.tracking, cfg.target.model, run_name="retrain-plan-tests") as tracker:
            name = tracker.registered_model_name
            version = register_head(tracker, tracker.run_id, head, name, tags={}, metrics={})
            champion = tracker.client.get_registered_model(name).aliases.get("champion")
            measured = {champion: champion_score} if champion and champion_score is not None else {}
            decision = promote_if_better(tracker, name, version.version, 1.0 if promote else 0.5, 0.0, True,
                                         measured=measured)
        assert decision.promoted is promote, decision.reason
        return str(version.version)


@pytest.fixture
def world(tmp_path, tracking, embedded_target, make_head_dir) -> World:
    lines = (REPO / "data" / "prompts" / "code_train.jsonl").read_text().splitlines()
    (tmp_path / "prompts.jsonl").write_text("\n".join(lines[:20]) + "\n")
    overrides = {
        "workdir": str(tmp_path / "run"),
        "tracking.tracking_uri": tracking.tracking_uri,
        "tracking.registered_model": f"peagle-retrain-plan-{next(_models)}",
        "data.sources": [{"kind": "jsonl", "path": str(tmp_path / "prompts.jsonl"), "schema": "messages"}],
    }
    return World(tmp_path, overrides, make_head_dir)


@pytest.fixture
def trained(world):
    """The world with a champion trained on its current inputs: (cfg, target, champion version)."""
    cfg = world.cfg()
    target = prepare_target(cfg)
    return cfg, target, world.register(cfg, target, promote=True)


def local_target(world, embedded_target, name: str) -> Path:
    """A copy of the embedded target's files in a directory of the user's own."""
    return Path(shutil.copytree(embedded_target, world.tmp / name))


# ----------------------------------------------------------------------------- reasons to retrain


def test_no_champion_yet_retrains(world):
    plan = plan_retraining(world.cfg(), prepare_target(world.cfg()))
    assert plan.retrain and plan.changes == ["no champion yet"] and plan.champion is None


def test_new_prompt_data_retrains(world, trained):
    cfg, target, champion = trained
    lines = (REPO / "data" / "prompts" / "code_train.jsonl").read_text().splitlines()
    with open(world.prompts, "a") as fh:
        fh.write("\n".join(lines[20:24]) + "\n")
    plan = plan_retraining(cfg, target)
    assert plan.retrain and plan.champion == champion
    assert plan.changes == [f"prompt file {world.prompts} changed (new prompt data)"]
    assert not plan.rebuild_data  # the dataset grows: only the new prompts are generated


def test_an_edited_prompt_file_and_a_new_source_retrain(world, trained):
    cfg, target, _ = trained
    world.prompts.write_text(world.prompts.read_text().replace('"content": "', '"content": "Briefly: ', 1))
    extra = world.tmp / "more.jsonl"
    extra.write_text(world.prompts.read_text().splitlines()[0] + "\n")
    sources = [*world.overrides["data.sources"], {"kind": "jsonl", "path": str(extra), "schema": "messages"}]
    plan = plan_retraining(world.cfg(**{"data.sources": sources}), target)
    assert plan.retrain
    assert f"prompt file {world.prompts} changed (new prompt data)" in plan.changes
    assert f"new prompt source {extra}" in plan.changes


def test_a_new_hub_commit_retrains(world, embedded_target):
    """The hub moved ``main`` to a new commit: offline, the cached snapshot's ref tells it."""
    cache = world.tmp / "hf-cache"
    refs = cache / "models--acme--coder" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text("a" * 40)
    cfg = world.cfg(**{"target.model": "acme/coder"})
    facts = prepare_target(world.cfg()).facts  # the hub target's facts are not what this test is about

    def hub_target() -> TargetInfo:
        revision = hub_revision("acme/coder", cfg.target.revision, cache_dir=cache)
        assert "cached snapshot" in revision.source  # the suite runs offline (tests/conftest.py)
        return TargetInfo("acme/coder", facts, revision.value, revision.source)

    world.register(cfg, hub_target(), promote=True)
    assert not plan_retraining(cfg, hub_target()).retrain
    (refs / "main").write_text("b" * 40)
    plan = plan_retraining(cfg, hub_target())
    assert plan.retrain and plan.changes == [f"target revision changed ({'a' * 40} -> {'b' * 40})"]


def test_a_local_target_whose_files_changed_retrains(world, embedded_target):
    model_dir = local_target(world, embedded_target, "my-coder")
    cfg = world.cfg(**{"target.model": str(model_dir)})
    world.register(cfg, prepare_target(cfg), promote=True)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0.7}))
    plan = plan_retraining(cfg, prepare_target(cfg))
    assert plan.retrain and len(plan.changes) == 1 and plan.changes[0].startswith("target revision changed (local:")


def test_a_weight_changing_config_retrains(world, trained):
    cfg, target, _ = trained
    plan = plan_retraining(with_train(cfg, {"recipe.learning_rate": cfg.train.recipe.learning_rate / 2}), target)
    assert plan.retrain and plan.changes[0].startswith("drafter/train config or method changed")
    deeper = cfg.model_copy(update={"drafter": cfg.drafter.model_copy(update={"num_layers": cfg.drafter.num_layers + 1})})
    assert plan_retraining(deeper, target).retrain


def test_a_changed_data_config_retrains_and_rebuilds_the_dataset(world, trained):
    cfg, target, _ = trained
    plan = plan_retraining(world.cfg(**{"data.heldout_samples": cfg.data.heldout_samples + 1}), target)
    assert plan.retrain and plan.rebuild_data and plan.changes[0].startswith("data/target config changed")


def test_a_magpie_file_is_new_prompt_data_only_once_it_changes(world):
    """The data stage records the magpie file it wrote; the plan names it the same way: nothing
    new while it is unchanged, new prompt data once the target's requests are sampled again."""
    magpie = world.tmp / "magpie.jsonl"
    sources = [*world.overrides["data.sources"], {"kind": "magpie", "path": str(magpie), "max_samples": 2}]
    cfg = world.cfg(**{"data.sources": sources})
    target = prepare_target(cfg)
    assert plan_retraining(cfg, target).changes == ["no champion yet"]
    magpie.write_text(world.prompts.read_text().splitlines()[0] + "\n")  # what the data stage wrote
    champion = world.register(cfg, target, promote=True)
    plan = plan_retraining(cfg, target)
    assert not plan.retrain and plan.message.startswith(f"nothing new: champion v{champion}")
    magpie.write_text(world.prompts.read_text().splitlines()[1] + "\n")
    assert plan_retraining(cfg, target).changes == [f"prompt file {magpie} changed (new prompt data)"]


def test_a_champion_that_named_a_local_file_by_config_retrains_once(world):
    """A lineage that named a local file like a hub set ("hub:<path>@<split>/") is reported once,
    as such; the head retrained then records the file by content."""
    cfg = world.cfg()
    target = prepare_target(cfg)
    current = lineage(cfg, target)
    named = {str(world.prompts): f"hub:{world.prompts}@train/"}
    world.register(cfg, target, promote=True, recorded={**current, "prompt_files": json.dumps(named)})
    plan = plan_retraining(cfg, target)
    assert plan.retrain and plan.changes == [
        f"prompt source {world.prompts} was recorded by name (hub:{world.prompts}@train/), not by what was read: "
        "retraining records its content"]
    world.register(cfg, target, promote=False, champion_score=2.0)
    assert not plan_retraining(cfg, target).retrain


def test_forced_retrains_with_nothing_new(world, trained):
    cfg, target, champion = trained
    plan = plan_retraining(cfg, target, force=True)
    assert plan.retrain and plan.changes == ["forced"] and plan.champion == champion


# ----------------------------------------------------------------------------- reasons not to


def test_the_same_inputs_do_not_retrain(world, trained):
    cfg, target, champion = trained
    plan = plan_retraining(cfg, target)
    assert not plan.retrain and plan.changes == []
    assert plan.message.startswith(f"nothing new: champion v{champion} was trained on these inputs")


@pytest.mark.parametrize("change", [{"train.checkpoints.keep_last": 9, "train.checkpoints.eval_every": 50,
                                     "train.checkpoints.save_every": 7},
                                    {"train.baseline.eagle3": True}, {"train.init_from": "champion"}],
                         ids=["bookkeeping", "baseline-beside", "warm-start"])
def test_bookkeeping_and_a_warm_start_do_not_retrain(world, trained, change):
    _, target, _ = trained
    assert not plan_retraining(world.cfg(**change), target).retrain


def test_the_same_target_copied_elsewhere_does_not_retrain(world, embedded_target):
    """The CLI and a worker see one target at two paths: same content, same revision."""
    on_cli = local_target(world, embedded_target, "cli-disk")
    on_worker = local_target(world, embedded_target, "worker-disk")
    cli = world.cfg(**{"target.model": str(on_cli)})
    world.register(cli, prepare_target(cli), promote=True)
    worker = world.cfg(**{"target.model": str(on_worker)})
    target = prepare_target(worker)
    assert target.revision == prepare_target(cli).revision and target.revision.startswith("local:")
    assert not plan_retraining(worker, target).retrain


def test_a_challenger_refused_on_the_same_inputs_is_not_trained_again(world, trained):
    """The champion predates the new prompts; the head trained on them lost in the gate."""
    cfg, target, champion = trained
    with open(world.prompts, "a") as fh:
        fh.write(world.prompts.read_text().splitlines()[0] + "\n")
    target = prepare_target(cfg)
    refused = world.register(cfg, target, promote=False, champion_score=2.0)
    plan = plan_retraining(cfg, target)
    assert not plan.retrain and plan.champion == champion
    assert f"v{refused} (refused: score 0.5000 vs champion v{champion} 2.0000 measured in the same run" in plan.message
    assert plan_retraining(cfg, target, force=True).retrain
