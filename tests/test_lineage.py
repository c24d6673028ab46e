"""A head's lineage (peagle.lineage): the target revision names content, never a path; a head
ships the lineage of the inputs it provably was trained on."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "train"))  # the tiny-run builders
from test_deepspeed import tiny_config, tiny_facts, tiny_run  # noqa: E402,F401 (fixtures)

from peagle.config import ConfigError, TargetConfig, with_overrides  # noqa: E402
from peagle.layout import LINEAGE_FILE, DataLayout  # noqa: E402
from peagle.lineage import (  # noqa: E402
    DATASET_KEYS,
    head_lineage,
    hub_revision,
    local_content_digest,
    read_head_lineage,
    record_dataset_inputs,
    target_revision,
)


def model_dir(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    (path / "model.safetensors").write_bytes(b"\0" * 64)
    return path


def test_a_local_target_is_named_by_its_model_files_not_its_path(tmp_path):
    first, second = model_dir(tmp_path / "here"), model_dir(tmp_path / "elsewhere")
    (second / "README.md").write_text("# notes\n")  # documentation and dotfiles are not the model
    (second / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (second / "build_report.json").write_text('{"seconds": 12.5}')
    revision = target_revision(TargetConfig(model=str(first)), str(first))
    assert revision.value == target_revision(TargetConfig(model=str(second)), str(second)).value
    assert revision.value.startswith("local:") and str(tmp_path) not in revision.value
    assert revision.source == "content hash of 3 model files of a local directory"
    (second / "tokenizer.json").write_text('{"model": {"vocab": {"b": 0}}}')  # same size, other vocabulary
    assert target_revision(TargetConfig(model=str(second)), str(second)).value != revision.value


def test_file_digests_are_reused_while_size_and_mtime_are_unchanged(tmp_path):
    """What keeps a 16 GB target cheap on every scheduled run: one hash per file version."""
    root = model_dir(tmp_path / "m")
    before, _ = local_content_digest(root)
    weights = root / "model.safetensors"
    stat = weights.stat()
    weights.write_bytes(b"\1" * 64)  # same size; mtime put back: the cache cannot tell
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert local_content_digest(root)[0] == before
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # touched: hashed again
    assert local_content_digest(root)[0] != before


def test_an_empty_directory_is_no_target(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no model files"):
        local_content_digest(tmp_path / "empty")


def test_a_hub_revision_offline_is_the_cached_snapshots_commit(tmp_path):
    refs = tmp_path / "models--acme--coder" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text("1" * 40 + "\n")
    (refs / "v2").write_text("2" * 40)
    assert hub_revision("acme/coder", cache_dir=tmp_path).value == "1" * 40
    tagged = hub_revision("acme/coder", "v2", cache_dir=tmp_path)
    assert tagged.value == "2" * 40 and tagged.source.startswith("commit of the cached snapshot acme/coder@v2")
    pinned = hub_revision("acme/coder", "3" * 40, cache_dir=tmp_path)  # a commit needs no lookup
    assert pinned.value == "3" * 40 and pinned.source == "the configured commit of acme/coder"
    with pytest.raises(ConfigError, match=r"acme/other.*no snapshot of 'main'.*HF_TOKEN"):
        hub_revision("acme/other", cache_dir=tmp_path)


# ----------------------------------------------------------------------------- a head's own lineage


@pytest.fixture(scope="module")
def trained(tiny_run, tmp_path_factory):
    """One tiny training (1 step) on the tiny dataset: (cfg, data_dir, target, checkpoint)."""
    from peagle.train.trainer import train_drafter

    data_dir, target = tiny_run
    cfg = tiny_config(max_steps=1).model_copy(update={"workdir": str(tmp_path_factory.mktemp("run"))})
    out = tmp_path_factory.mktemp("ckpt")
    train_drafter(cfg, data_dir, str(target), out, progress=False)
    return cfg, data_dir, target, out / "latest"


def test_export_writes_the_lineage_the_checkpoint_was_trained_on(trained):
    from peagle.identity import training_hash
    from peagle.stages import TargetInfo, export_head

    cfg, data_dir, target, checkpoint = trained
    inputs = {"data_config_hash": "d1", "target_revision": "local:0123", "prompt_files": '{"p.jsonl": "h"}'}
    record_dataset_inputs(data_dir, inputs)
    head = export_head(cfg, TargetInfo(str(target), tiny_facts()), data_dir, checkpoint)
    lineage = read_head_lineage(head)
    assert {k: lineage[k] for k in DATASET_KEYS} == inputs
    assert lineage["train_config_hash"] == training_hash(cfg)
    assert set(json.loads(lineage["data_manifests"])) == {"train"}  # the tiny dataset has no eval split


def test_no_lineage_for_a_checkpoint_of_other_inputs(trained, tmp_path):
    cfg, data_dir, _, checkpoint = trained
    record_dataset_inputs(data_dir, {"data_config_hash": "d", "target_revision": "r", "prompt_files": "{}"})
    other = with_overrides(cfg, {"train.recipe.learning_rate": 0.5})
    values, why = head_lineage(other, data_dir, checkpoint, "peagle")
    assert values is None and "was not trained on" in why
    DataLayout(data_dir).lineage.unlink()  # a dataset built before datasets recorded their inputs
    values, why = head_lineage(cfg, data_dir, checkpoint, "peagle")
    assert values is None and LINEAGE_FILE in why


def test_an_unreachable_hub_falls_back_to_the_cached_snapshot_and_says_why(tmp_path):
    """Online but the hub does not answer (here: nothing listens at HF_ENDPOINT): the cached
    snapshot's commit, with the reason in the source the logs show."""
    import subprocess

    from tests.mlflow_server import free_port

    refs = tmp_path / "models--acme--coder" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text("4" * 40)
    code = ("import sys; from peagle.lineage import hub_revision; "
            "r = hub_revision('acme/coder', cache_dir=sys.argv[1]); print(r.value); print(r.source)")
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    value, source = out.stdout.strip().splitlines()[-2:]
    assert value == "4" * 40
    assert source.startswith("commit of the cached snapshot acme/coder@main (the hub did not answer: ")


# ----------------------------------------------------------------------------- prompt sources, as read


def magpie_config(tmp_path):
    """tiny.yaml with a prompt file and a kind: magpie source, as configs/demo.yaml has."""
    from peagle.config import load_config

    repo = Path(__file__).resolve().parents[1]
    return load_config(repo / "configs" / "tiny.yaml", {"data.sources": [
        {"kind": "jsonl", "path": "data/prompts/code_train.jsonl", "schema": "messages"},
        {"kind": "magpie", "path": str(tmp_path / "self.jsonl"), "max_samples": 2}]})


def test_a_magpie_source_is_recorded_as_written_and_nothing_is_new_after_the_run(tmp_path):
    """The data stage names each source after a magpie file is written (``DatasetInfo.prompt_files``);
    retraining names the current inputs with the same function, so right after the run they agree."""
    from peagle.data.provenance import NOT_WRITTEN, source_digests
    from peagle.lineage import changes_since, dataset_inputs, lineage, prompt_file_hashes
    from peagle.stages import TargetInfo

    cfg, magpie = magpie_config(tmp_path), str(tmp_path / "self.jsonl")
    target = TargetInfo(str(tmp_path), tiny_facts(), revision="local:0123")
    before = prompt_file_hashes(cfg)
    assert before[magpie] == NOT_WRITTEN  # not a hub dataset: its own source is about to write it
    (tmp_path / "self.jsonl").write_text('{"messages": [{"role": "user", "content": "Sort a list in place."}]}\n')
    read = source_digests(cfg.data.sources, {})  # what build_dataset names after synthesize_prompts
    assert read[magpie] == sha256_of(tmp_path / "self.jsonl")
    recorded = {**dataset_inputs(cfg, target, read), "train_config_hash": lineage(cfg, target)["train_config_hash"]}
    assert changes_since(recorded, lineage(cfg, target)) == []  # nothing new right after the run
    (tmp_path / "self.jsonl").unlink()  # deleted: the data stage samples it again
    assert changes_since(recorded, lineage(cfg, target)) == [
        f"prompt file {magpie} is not written yet: its kind: magpie source writes it anew (new prompt data)"]


def test_a_lineage_naming_a_local_file_as_a_hub_set_is_reported_once(tmp_path):
    """A champion whose lineage named a magpie file by its config ("hub:<path>@<split>/"): retrained
    once, saying so; the head trained then records the file's content, and nothing is new after."""
    from peagle.lineage import changes_since, lineage
    from peagle.stages import TargetInfo

    cfg, magpie = magpie_config(tmp_path), str(tmp_path / "self.jsonl")
    (tmp_path / "self.jsonl").write_text('{"messages": [{"role": "user", "content": "Sort a list in place."}]}\n')
    target = TargetInfo(str(tmp_path), tiny_facts(), revision="local:0123")
    current = lineage(cfg, target)
    named = {**json.loads(current["prompt_files"]), magpie: f"hub:{magpie}@train/"}
    champion = {**current, "prompt_files": json.dumps(named, sort_keys=True)}
    assert changes_since(champion, current) == [
        f"prompt source {magpie} was recorded by name (hub:{magpie}@train/), not by what was read: "
        "retraining records its content"]
    assert changes_since(current, lineage(cfg, target)) == []


def test_a_missing_prompt_file_stops_retraining_with_its_name(tmp_path):
    from peagle.lineage import prompt_file_hashes

    cfg = magpie_config(tmp_path)
    gone = cfg.model_copy(update={"data": cfg.data.model_copy(update={"sources": [
        cfg.data.sources[0].model_copy(update={"path": str(tmp_path / "moved.jsonl")})]})})
    with pytest.raises(ConfigError, match=rf"file not found: {tmp_path / 'moved.jsonl'}.*kind: hf"):
        prompt_file_hashes(gone)


def sha256_of(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()
