"""A head ready for the Hugging Face Hub: its card's metadata as huggingface_hub reads it (the
target as `base_model`, the target's license, never a made-up one), and `peagle push`, which
checks the head and its card before anything leaves the machine."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from huggingface_hub import ModelCard, constants

from peagle.config import load_config
from peagle.export.card import BASE_MODEL_NOTE, ModelCardInfo, TargetMetadata, read_serve_line
from peagle.export.head import export_head
from peagle.export.hub import plan_upload
from peagle.target.metadata import target_metadata
from tests.peagle_cli import assert_refused, peagle

REPO = Path(__file__).resolve().parents[2]
HUB_TARGET = "org/tiny-target"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
METHOD_TAGS = {"speculative-decoding", "eagle3", "p-eagle", "vllm", "peagle"}
NVIDIA_LICENSE = {"license": "other", "license_name": "nvidia-open-model-license",
                  "license_link": "https://www.nvidia.com/en-us/agreements/enterprise-software/nvidia-open-model-license"}


def cache_target_card(cache: Path, repo_id: str, front_matter: dict) -> None:
    """The hub target's README.md as huggingface_hub caches a download of it (refs/main -> snapshot)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    card = repo / "snapshots" / COMMIT / "README.md"
    card.parent.mkdir(parents=True)
    card.write_text("---\n" + "".join(f"{k}: {v}\n" for k, v in front_matter.items()) + "---\n\n# The target\n")


def tiny_config(**overrides):
    return load_config(REPO / "configs" / "tiny.yaml", overrides)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache of this test (HF_HUB_OFFLINE is set for the whole suite)."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.mark.parametrize("target_card", [{"license": "llama3.1"}, NVIDIA_LICENSE], ids=["hub-license", "other-named"])
def test_a_hub_targets_head_names_it_as_base_model_and_carries_its_license(
        tmp_path, hub_cache, target_card, state, spec, vocab, tiny_target):
    cache_target_card(hub_cache, HUB_TARGET, target_card)
    metadata = target_metadata(tiny_config(**{"target.model": HUB_TARGET}), HUB_TARGET)
    assert metadata == TargetMetadata(hub_id=HUB_TARGET, **target_card)

    hub_spec = replace(spec, target=HUB_TARGET)
    head = export_head(state, hub_spec, vocab, tmp_path / "head", ModelCardInfo(target=metadata), target_path=tiny_target)
    card = ModelCard.load(head / "README.md")
    data = card.data.to_dict()
    assert data["base_model"] == HUB_TARGET
    assert {k: data.get(k) for k in target_card} == target_card
    assert data["pipeline_tag"] == "text-generation" and data["library_name"] == "vllm"
    assert METHOD_TAGS <= set(data["tags"])
    assert "base_model_relation" not in data  # a drafter is none of the Hub's relations
    name = target_card.get("license_name", target_card["license"])
    assert f"It carries the target's license, `{name}`" in card.text and BASE_MODEL_NOTE not in card.text
    assert read_serve_line(card.content).target_ref == HUB_TARGET


def test_a_hub_target_without_a_cached_card_offline_gets_license_other(hub_cache):
    assert target_metadata(tiny_config(**{"target.model": HUB_TARGET}), HUB_TARGET) == TargetMetadata(hub_id=HUB_TARGET)


def test_a_local_target_names_no_base_model_and_an_unknown_license(head, tiny_target):
    """The tiny target is a directory with no card: nothing is known, and the card says so."""
    assert target_metadata(tiny_config(**{"target.model": str(tiny_target)}), str(tiny_target)) == TargetMetadata()
    card = ModelCard.load(head / "README.md")
    data = card.data.to_dict()
    assert "base_model" not in data and data["license"] == "other" and "license_name" not in data
    assert data["pipeline_tag"] == "text-generation" and METHOD_TAGS <= set(data["tags"])
    assert BASE_MODEL_NOTE in card.text
    assert "set `license` in the front matter above to the target's Hub license id" in card.text


def test_a_local_targets_license_comes_from_its_card_and_its_hub_id_from_the_config(tmp_path):
    target = tmp_path / "my-model"
    target.mkdir()
    (target / "README.md").write_text("---\nlicense: apache-2.0\nbase_model: someone/its-own-base\n---\n# My model\n")
    found = target_metadata(tiny_config(**{"target.model": str(target)}), str(target))
    assert found == TargetMetadata(license="apache-2.0")  # the target's own base_model is not the target
    named = target_metadata(tiny_config(**{"target.model": str(target), "card.base_model": "me/my-model",
                                           "card.license": "mit"}), str(target))
    assert named == TargetMetadata(hub_id="me/my-model", license="mit")


def test_a_target_in_the_hub_cache_is_named_by_its_repository(tmp_path):
    snapshot = tmp_path / "hub" / "models--meta-llama--Llama-3.1-8B-Instruct" / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "README.md").write_text("---\nlicense: llama3.1\n---\n")
    assert target_metadata(tiny_config(**{"target.model": str(snapshot)}), str(snapshot)) == TargetMetadata(
        hub_id="meta-llama/Llama-3.1-8B-Instruct", license="llama3.1")


def test_a_base_model_that_is_not_a_hub_id_is_refused_at_load():
    from peagle.config import ConfigError

    with pytest.raises(ConfigError, match=r"card.base_model './models/mine' is not a hub id"):
        tiny_config(**{"card.base_model": "./models/mine"})


@pytest.fixture
def hub_head(tmp_path, state, spec, vocab, tiny_target):
    """A head exported for a hub target whose license is known."""
    card = ModelCardInfo(target=TargetMetadata(hub_id=HUB_TARGET, license="llama3.1"))
    return export_head(state, replace(spec, target=HUB_TARGET), vocab, tmp_path / "hub-head", card,
                       target_path=tiny_target)


@pytest.mark.slow
def test_push_dry_run_lists_each_file_and_the_repository(hub_head):
    said = peagle("push", hub_head, "me/tiny-p-eagle", "--dry-run")
    assert said.returncode == 0, said.output
    assert "would upload 3 files" in said and "https://huggingface.co/me/tiny-p-eagle" in said
    for name in ("config.json", "model.safetensors", "README.md"):
        assert f" {name} " in said.output
    size = (hub_head / "model.safetensors").stat().st_size / 2**20
    assert f"model.safetensors {size:.1f} MiB" in said
    assert "nothing was uploaded (--dry-run)" in said and "warning:" not in said.output


def test_the_uploaded_card_serves_the_head_from_its_repository(hub_head):
    upload = plan_upload(hub_head, "me/tiny-p-eagle")
    line = read_serve_line(upload.card)
    assert (line.target_ref, line.head_ref, line.parallel_drafting) == (HUB_TARGET, "me/tiny-p-eagle", True)
    assert ModelCard(upload.card).data.base_model == HUB_TARGET
    assert upload.files["README.md"] == len(upload.card.encode())
    assert (hub_head / "README.md").read_text() != upload.card  # the head directory itself is left as it is


@pytest.mark.slow
def test_push_refuses_a_head_of_unknown_license(head):
    assert_refused(peagle("push", head, "me/tiny-p-eagle", "--dry-run"),
                   "names no license of the target (license: other)", "set card.license in the config")


@pytest.mark.slow
def test_push_refuses_a_broken_head_before_any_upload(hub_head, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(hub_head, broken)
    (broken / "model.safetensors").unlink()
    assert_refused(peagle("push", broken, "me/tiny-p-eagle", "--dry-run"), "model.safetensors is missing")
    assert_refused(peagle("push", hub_head, "not a repo", "--dry-run"), "is not a Hub repository id")


@pytest.mark.slow
def test_a_push_offline_fails_in_one_line_before_any_upload(hub_head):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_TOKEN": "hf_not_a_real_token_0000",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "peagle.cli", "push", str(hub_head), "me/tiny-p-eagle"], cwd=REPO,
                          env={**env, "COLUMNS": "80"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stdout + done.stderr
    said = [line for line in done.stdout.splitlines() if line.strip()]
    assert said == ["HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set, so the Hub cannot be reached: unset it to push "
                    "(`peagle push --dry-run` lists the upload offline)"], done.stdout
    assert "Traceback" not in done.stderr and "hf_not_a_real_token" not in done.stdout + done.stderr
