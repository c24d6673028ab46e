"""One identity of a trained head (peagle.identity): where and when it trains never counts, what it is does,
and the Prefect training key, the retraining lineage and the resume check agree."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "train"))  # the tiny-run builders
from test_deepspeed import one_thread, tiny_config, tiny_facts, tiny_run, tiny_spec  # noqa: E402,F401 (fixtures)

from peagle.catalogue import DESCRIPTIONS  # noqa: E402
from peagle.config import TrainConfig  # noqa: E402
from peagle.identity import head_identity, training_fields, training_hash  # noqa: E402
from peagle.lineage import changes_since, lineage  # noqa: E402
from peagle.stages import HeadPlan, TargetInfo, identity_of, with_train  # noqa: E402

# A change in each part of train that says where and when a head trains, never what it is.
WHERE_AND_WHEN = {"checkpoints.keep_last": 7, "checkpoints.save_every": 3, "checkpoints.eval_every": 5,
                  "baseline.eagle3": True, "baseline.budget": "same_time", "init_from": "/heads/champion-v3",
                  "launch.attention": "dense", "launch.zero_stage": 1, "launch.offload_optimizer": True,
                  "launch.devices": ["0"], "launch.rdzv_timeout_s": 60}
WEIGHT_CHANGES = {"recipe.learning_rate": 3e-4, "peagle.k_train": 5, "method": "eagle3", "recipe.seed": 1,
                  "recipe.batch_size": 2, "recipe.epochs": 2, "recipe.loss_depth_weighting": "per_depth_mean",
                  "recipe.optimizer": "muon", "recipe.max_train_seconds": 600.0}
DATASET = {"train": "aa", "eval": "bb"}


@pytest.fixture
def inputs(tmp_path):
    """A config whose prompt file and target directory exist (lineage reads both)."""
    (tmp_path / "prompts.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{}")
    cfg = tiny_config().model_copy(update={"data": tiny_config().data.model_copy(
        update={"sources": [tiny_config().data.sources[0].model_copy(update={"path": str(tmp_path / "prompts.jsonl")})]})})
    return cfg, TargetInfo(path=str(tmp_path / "target"), facts=tiny_facts())


def key_of(cfg, target):
    """Every definition of a head's identity, side by side: the Prefect key is the head plan's."""
    from flows.cache_keys import training_key

    data = Path("/nonexistent-data")
    plan = HeadPlan(cfg.train.method, cfg, data, identity_of(cfg, data), data / "unused")
    return {"identity": head_identity(cfg, DATASET), "lineage": lineage(cfg, target)["train_config_hash"],
            "prefect": training_key(plan)}


def test_where_and_when_a_head_trains_never_counts(inputs):
    cfg, target = inputs
    parts = {name for name, field in TrainConfig.model_fields.items() if name not in ("method", "recipe")}
    assert {key.split(".")[0] for key in WHERE_AND_WHEN} == parts - set(DESCRIPTIONS)  # every other part tried
    before = key_of(cfg, target)
    for field, value in WHERE_AND_WHEN.items():
        changed = with_train(cfg, {field: value})
        assert key_of(changed, target) == before, field
        assert changes_since(lineage(cfg, target), lineage(changed, target)) == [], field  # retraining: nothing new


@pytest.mark.parametrize("field", sorted(WEIGHT_CHANGES))
def test_a_field_that_changes_the_weights_changes_every_key(inputs, field):
    cfg, target = inputs
    changed = with_train(cfg, {field: WEIGHT_CHANGES[field]})
    before, after = key_of(cfg, target), key_of(changed, target)
    assert all(before[k] != after[k] for k in before), (field, before, after)
    assert changes_since(lineage(cfg, target), lineage(changed, target)) == [
        f"drafter/train config or method changed ({before['lineage']} -> {after['lineage']})"]


def test_the_drafter_shape_and_the_dataset_count(inputs):
    cfg, target = inputs
    deeper = cfg.model_copy(update={"drafter": cfg.drafter.model_copy(update={"num_layers": cfg.drafter.num_layers + 1})})
    assert training_hash(deeper) != training_hash(cfg)
    assert head_identity(cfg, {**DATASET, "train": "cc"}) != head_identity(cfg, DATASET)


def test_fields_of_another_method_do_not_count():
    peagle, eagle3 = tiny_config(), tiny_config(method="eagle3")
    assert training_hash(with_train(peagle, {"eagle3.ttt_steps": 3})) == training_hash(peagle)
    assert training_hash(with_train(peagle, {"eagle3.num_layers": 3})) == training_hash(peagle)
    assert training_hash(with_train(eagle3, {"eagle3.num_layers": 3})) != training_hash(eagle3)
    assert training_hash(with_train(eagle3, {"peagle.k_train": 7, "peagle.cod_ratio": 0.5})) == training_hash(eagle3)
    assert training_hash(with_train(eagle3, {"eagle3.ttt_steps": 3})) != training_hash(eagle3)
    # a head of another method on the same config is another head
    assert training_hash(peagle, "eagle3") == training_hash(eagle3) != training_hash(peagle)


def test_resume_follows_the_identity(tiny_run, tmp_path):
    """keep_last may change between a run and its resume; the learning rate may not."""
    from peagle import checkpoint_format as fmt
    from peagle.train.trainer import train_drafter

    data_dir, target = tiny_run
    out = tmp_path / "out"
    train_drafter(tiny_config(max_steps=1), data_dir, str(target), out, progress=False)
    resumed = train_drafter(tiny_config(max_steps=1, keep_last=5, save_every=1), data_dir, str(target), out,
                            progress=False)
    assert resumed.last_checkpoint == out / "step-000001"  # resumed at its end: nothing retrained
    state = json.loads((out / "step-000001" / "trainer_state.json").read_text())
    from peagle.identity import dataset_manifests

    assert state["head_identity"] == head_identity(tiny_config(max_steps=1), dataset_manifests(data_dir))
    assert fmt.latest_checkpoint(out) == out / "step-000001"
    with pytest.raises(ValueError, match=r"cannot resume .*\(head identity \(dataset, weight-changing config"):
        train_drafter(tiny_config(max_steps=1, learning_rate=1e-2), data_dir, str(target), out, progress=False)


def test_the_identity_is_the_recipe_the_methods_block_and_the_drafter():
    """Every recipe field counts (the optimizer, Muon's learning rate); the other method's block,
    the launch, the checkpoints and the baseline do not."""
    adamw = with_train(tiny_config(), {"recipe.optimizer": "adamw"})
    assert training_fields(adamw)["recipe"]["optimizer"] == "adamw"
    assert set(training_fields(adamw)) == {"drafter", "method", "recipe", "peagle"}
    muon = with_train(adamw, {"recipe.optimizer": "muon"})
    assert training_hash(with_train(muon, {"recipe.muon_learning_rate": 0.05})) != training_hash(muon) != training_hash(adamw)
    unchanged = {"eagle3.ttt_steps": 2, "launch.zero_stage": 1, "launch.attention": "dense", "checkpoints.keep_last": 9,
                 "baseline.eagle3": True, "init_from": "/heads/previous"}
    assert training_hash(with_train(adamw, unchanged)) == training_hash(adamw)
    assert training_hash(with_train(adamw, {"eagle3.ttt_steps": 2}), "eagle3") != training_hash(adamw, "eagle3")


def test_the_dataset_key_of_a_run_with_a_magpie_source_is_the_same_before_and_after_it_writes_the_file(inputs):
    """A rerun finds the first run's dataset: the magpie file the first run wrote does not change
    the key it was cached under; a grown prompt file does."""
    from flows.cache_keys import dataset_key
    from peagle.config import PromptSource

    cfg, target = inputs
    magpie = Path(cfg.data.sources[0].path).with_name("magpie.jsonl")
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"sources": [
        *cfg.data.sources, PromptSource(kind="magpie", path=str(magpie), max_samples=2)]})})
    before = dataset_key(cfg, target)
    magpie.write_text('{"messages": [{"role": "user", "content": "Write a sort."}]}\n')
    assert dataset_key(cfg, target) == before
    with open(cfg.data.sources[0].path, "a") as fh:
        fh.write('{"messages": [{"role": "user", "content": "more"}]}\n')
    assert dataset_key(cfg, target) != before
