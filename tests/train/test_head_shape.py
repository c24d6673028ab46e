"""The drafter's shape is the checkpoint's, not the dataset's.

Changing ``drafter.num_layers`` between two trainings in one run directory on one cached
dataset gives a head of the new shape through every later stage (offline evaluation,
export, the model card), with the dataset untouched and the old head kept. Through the
real stage functions and the real launcher.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).parent))  # the tiny-run builders live in test_deepspeed.py
from test_deepspeed import build_tiny_dataset, build_tiny_target, tiny_config  # noqa: E402

from peagle import stages  # noqa: E402
from peagle.checkpoint_format import read_head_spec, read_trainer_state  # noqa: E402
from peagle.facts import load_dataset_facts  # noqa: E402
from peagle.layout import DataLayout, RunLayout  # noqa: E402


def head_layers(head: Path) -> set[int]:
    with safe_open(str(head / "model.safetensors"), "pt") as f:
        return {int(m.group(1)) for key in f.keys() if (m := re.match(r"layers\.(\d+)\.", key))}


@pytest.fixture
def cached_dataset(tmp_path):
    target = build_tiny_target(tmp_path / "target")
    data_dir = build_tiny_dataset(tmp_path / "data", target, num_samples=8, num_eval=2)
    info = stages.TargetInfo(path=str(target), facts=load_dataset_facts(DataLayout(data_dir)))
    return info, data_dir


@pytest.mark.slow  # three launches of the trainer (two trainings, one resume): ~3 min on 2 shared cores
def test_a_changed_drafter_in_one_run_dir_trains_the_new_head_beside_the_old(cached_dataset, tmp_path, monkeypatch):
    """num_layers 1, then 2, in ONE run directory on one cached dataset: the second training
    starts fresh in a directory of its own identity (no "cannot resume" error) and ships the
    new shape; the first head stays, and rerunning its config reuses it."""
    from peagle.export.card import ModelCardInfo, write_card

    target, data_dir = cached_dataset
    dataset_files = {p: p.stat().st_mtime_ns for p in data_dir.rglob("*") if p.is_file()}
    configs = {layers: tiny_config(drafter_layers=layers, max_steps=2, eval_every=2).model_copy(
        update={"workdir": str(tmp_path / "run")}) for layers in (1, 2)}
    from peagle.data import check

    checks = []
    monkeypatch.setattr(check, "check_dataset", lambda path, real=check.check_dataset: checks.append(path) or real(path))
    best = {}
    for trainings, (layers, cfg) in enumerate(configs.items(), 1):
        plan = stages.plan_head(cfg, None, data_dir)
        trained = stages.train_head(plan, target)
        assert len(checks) == trainings, checks  # the dataset is checked once a training: by its plan
        # the ranks check a resume against the plan's identity, handed to them: one owner
        assert read_trainer_state(trained.best_checkpoint).head_identity == plan.identity
        assert plan.checkpoint_dir.name == plan.identity[:12]
        best[layers] = trained.best_checkpoint
        assert trained.best_checkpoint is not None  # chosen by acceptance: the ranks (peagle.rank) evaluated
        assert Path(trained.best_checkpoint).parent == stages.checkpoint_dir(cfg, "peagle", data_dir)
        spec = read_head_spec(trained.best_checkpoint)
        assert (spec.num_layers, spec.method, spec.k_train) == (layers, "peagle", 3)

        offline = stages.evaluate_offline(cfg, target, data_dir, trained.best_checkpoint)
        assert set(offline.acceptance_length) == {1, 3}  # eval.ks within the checkpoint's k_train

        head = stages.export_head(cfg, target, data_dir, trained.best_checkpoint)
        assert head == RunLayout(cfg.run_dir).head("peagle")
        assert head_layers(head) == set(range(layers))
        assert json.loads((head / "config.json").read_text())["num_hidden_layers"] == layers
        write_card(head, ModelCardInfo(name=f"tiny-{layers}"), trained.best_checkpoint)
        assert f"{layers} Llama decoder layers" in (head / "README.md").read_text()

    # One run directory, one checkpoint directory per head identity; both heads stay.
    trainings = RunLayout(tmp_path / "run").method_checkpoints("peagle")
    assert sorted(p.name for p in trainings.iterdir()) == sorted(Path(b).parent.name for b in best.values())
    assert Path(best[1]).parent != Path(best[2]).parent
    assert read_head_spec(stages.trained_checkpoint(configs[1], "peagle", data_dir)).num_layers == 1

    # The first config again: the same identity, so its finished training is resumed (no new step).
    first = Path(best[1]).parent
    files = {p: p.stat().st_mtime_ns for p in first.rglob("step-*/*")}
    again = stages.train_head(stages.plan_head(configs[1], None, data_dir), target)
    assert again.best_checkpoint == best[1]
    assert {p: p.stat().st_mtime_ns for p in first.rglob("step-*/*")} == files
    assert read_head_spec(again.best_checkpoint).num_layers == 1
    # Every training read the one dataset; none rewrote it.
    assert {p: p.stat().st_mtime_ns for p in data_dir.rglob("*") if p.is_file()} == dataset_files
