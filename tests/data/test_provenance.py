"""Each prompt source named by what the data stage reads from it (``peagle.data.provenance``):
a local file by content, a magpie file once written, a hub set at its commit; a missing local
file is an error naming it, never a hub dataset."""

import hashlib
import shutil

import pytest

from peagle.config import ConfigError, PromptSource
from peagle.data.provenance import NOT_WRITTEN, hub_commits, source_digest, source_digests

ROW = '{"messages": [{"role": "user", "content": "Write a function that adds two numbers."}]}\n'


def test_a_magpie_source_is_not_written_until_the_data_stage_writes_it(tmp_path):
    path = tmp_path / "self.jsonl"
    src = PromptSource(kind="magpie", path=str(path), max_samples=4)
    assert source_digest(src) == NOT_WRITTEN  # not a hub dataset, not an error: its source writes it
    path.write_text(ROW)
    assert source_digest(src) == hashlib.sha256(ROW.encode()).hexdigest()


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_missing_local_file_is_an_error_naming_it_never_a_hub_set(tmp_path, kind):
    missing = tmp_path / f"prompts.{kind}"
    sources = [PromptSource(kind="jsonl", path=str(tmp_path / "here.jsonl")), PromptSource(kind=kind, path=str(missing))]
    (tmp_path / "here.jsonl").write_text(ROW)
    with pytest.raises(ConfigError, match=rf"data\.sources\[1\] \({kind}:.*file not found: {missing}; fix "
                                          r"data\.sources\[1\]\.path \(a Hugging Face dataset is named with kind: hf\)"):
        source_digests(sources, {})


def test_a_glob_is_named_by_its_files_wherever_they_lie(tmp_path):
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir()
    (here / "a.jsonl").write_text(ROW)
    (here / "b.jsonl").write_text(ROW.replace("adds", "multiplies"))
    shutil.copytree(here, there)
    digest = source_digest(PromptSource(kind="jsonl", path=str(here / "*.jsonl")))
    assert digest == source_digest(PromptSource(kind="jsonl", path=str(there / "*.jsonl")))  # a worker's copy
    with open(there / "b.jsonl", "a") as fh:
        fh.write(ROW)
    assert source_digest(PromptSource(kind="jsonl", path=str(there / "*.jsonl"))) != digest


def test_a_hub_set_is_named_at_the_commit_its_cached_copy_names(tmp_path):
    """The suite runs offline (tests/conftest.py): the commit is the Hugging Face cache's, as
    ``datasets`` left it (the dataset card of the snapshot ``refs/main`` names)."""
    commit = "c" * 40
    repo = tmp_path / "datasets--acme--prompts"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "README.md").write_text("# prompts\n")
    cached = PromptSource(kind="hf", path="acme/prompts", subset="chat", split="train_sft")
    unknown = PromptSource(kind="hf", path="acme/never-downloaded")
    commits = hub_commits([cached, unknown], cache_dir=tmp_path)
    assert commits == {"acme/prompts": commit, "acme/never-downloaded": None}
    assert source_digests([cached, unknown], commits) == {
        "acme/prompts": f"hf:acme/prompts/chat:train_sft@{commit}",
        "acme/never-downloaded": "hf:acme/never-downloaded:train",  # neither hub nor cache tells: by name
    }


def test_an_unreachable_hub_falls_back_to_the_cached_commit(tmp_path):
    """Online but the hub does not answer (nothing listens at HF_ENDPOINT): the cache's commit."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.mlflow_server import free_port

    repo = tmp_path / "datasets--acme--prompts"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("d" * 40)
    (repo / "snapshots" / ("d" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("d" * 40) / "README.md").write_text("# prompts\n")
    code = ("import sys; from peagle.data.provenance import hub_dataset_commit; "
            "print(hub_dataset_commit('acme/prompts', cache_dir=sys.argv[1]))")
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "d" * 40
