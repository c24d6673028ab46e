"""`peagle export configs/tiny.yaml` in the README's form, on a run directory laid out as
training leaves it: the default checkpoint `best` is the trainer's JSON pointer file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import ModelCard
from safetensors.torch import save_file

from peagle.checkpoint_format import write_pointer
from peagle.config import load_config
from peagle.export.card import HEAD_PLACEHOLDER, TARGET_PLACEHOLDER, read_serve_line
from peagle.facts import head_spec_for
from peagle.layout import BEST
from peagle.testing.golden import draft_vocab_skipping_low_ids, random_head_state_dict

pytestmark = pytest.mark.slow  # each test runs `peagle export` in a process of its own (~12 s)

REPO = Path(__file__).resolve().parents[2]
DRAFT_VOCAB = 256


def trained_run(cfg, facts, spec) -> Path:
    """What the data and train stages leave: the target facts, the draft vocabulary and a
    pointed-at best step in the directory of the head trained on them."""
    from peagle import stages

    run_dir = cfg.run_dir
    vocab = draft_vocab_skipping_low_ids(spec.vocab_size, spec.draft_vocab_size, spec.mask_token_id)
    (run_dir / "data").mkdir(parents=True)
    facts.save(run_dir / "data" / "target_facts.json")
    save_file(dict(vocab), str(run_dir / "data" / "vocab.safetensors"))
    step = stages.checkpoint_dir(cfg, "peagle", run_dir / "data") / "step-000012"
    step.mkdir(parents=True)
    save_file(random_head_state_dict(spec, seed=2), str(step / "drafter.safetensors"))
    spec.save(step / "head_spec.json")
    write_pointer(step.parent, BEST, step.name, acceptance=1.7)
    return step


def test_readme_export_command_follows_the_best_pointer(embedded_target, tmp_path):
    from peagle import stages

    cfg = load_config("configs/tiny.yaml", {"workdir": str(tmp_path / "run")})
    facts = stages.prepare_target(cfg).facts.with_draft_vocab(DRAFT_VOCAB)
    trained_run(cfg, facts, head_spec_for(cfg, facts))

    done = subprocess.run([sys.executable, "-m", "peagle.cli", "export", "configs/tiny.yaml",
                           "--set", f"workdir={tmp_path / 'run'}", "--no-vllm-check"],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    head = cfg.run_dir / "heads" / "peagle"
    assert f"head: {head}" in "".join(done.stdout.split("\n"))
    card = (head / "README.md").read_text()
    assert str(tmp_path) not in card and str(embedded_target) not in card  # nothing of this machine
    assert ModelCard(card).data.base_model is None  # the embedded target has no hub id
    line = read_serve_line(card)
    assert (line.target_ref, line.head_ref, line.parallel_drafting) == (TARGET_PLACEHOLDER, HEAD_PLACEHOLDER, True)


def test_export_without_a_best_checkpoint_says_what_to_do(embedded_target, tmp_path):
    done = subprocess.run([sys.executable, "-m", "peagle.cli", "export", "configs/tiny.yaml",
                           "--set", f"workdir={tmp_path / 'run'}", "--no-vllm-check"],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 2, done.stdout + done.stderr
    said = " ".join(done.stdout.split())  # rich wraps long lines
    assert "no trained P-EAGLE head for this config and dataset" in said and "peagle train" in said


def test_a_local_targets_head_carries_its_license_and_the_configured_hub_id(tmp_path):
    """`peagle export` for a local target directory with its own model card: the head's card
    carries the target's license and names `card.base_model`; the run's later rewrite of the
    card with measured numbers keeps both."""
    from peagle import stages
    from peagle.export.card import ModelCardInfo, write_card
    from peagle.testing.golden import build_tiny_target

    target = build_tiny_target(tmp_path / "my-model")
    (target / "README.md").write_text("---\nlicense: mit\n---\n# My model\n")
    overrides = {"workdir": str(tmp_path / "run"), "target.model": str(target), "card.base_model": "me/my-model",
                 "train.recipe.max_len": 256, "data.max_seq_len": 256}  # the tiny target holds 512 positions
    cfg = load_config("configs/tiny.yaml", overrides)
    facts = stages.prepare_target(cfg).facts.with_draft_vocab(128)  # of its 384 ids
    step = trained_run(cfg, facts, head_spec_for(cfg, facts))

    done = subprocess.run([sys.executable, "-m", "peagle.cli", "export", "configs/tiny.yaml", "--no-vllm-check",
                           *[f"--set={k}={v}" for k, v in overrides.items()]],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    head = cfg.run_dir / "heads" / "peagle"
    for written in ("export", "rewrite"):
        card = ModelCard.load(head / "README.md")
        assert (card.data.base_model, card.data.license) == ("me/my-model", "mit"), written
        assert read_serve_line(card.content).target_ref == "me/my-model" and str(target) not in card.content
        write_card(head, ModelCardInfo(acceptance={3: 2.5}), step)
    assert "| 3 | 2.50 |" in (head / "README.md").read_text()
