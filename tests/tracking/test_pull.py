"""`pull_head`: which version a models:/ URI names, which target the card names, and what lands on disk."""

from __future__ import annotations

import pytest

from peagle.export.card import HEAD_PLACEHOLDER, TARGET_PLACEHOLDER, read_serve_line, serve_command
from peagle.publish.gate import promote_if_better
from peagle.publish.pull import pull_head, resolve_model_uri
from peagle.publish.registry import TAG_TARGET, register_head
from peagle.tracking.mlflow_run import Tracker

EXPORTED_CARD = "\n".join([
    "---", "license: apache-2.0", "library_name: vllm", "---", "", "# head", "", "```bash",
    serve_command(TARGET_PLACEHOLDER, HEAD_PLACEHOLDER, 4, parallel_drafting=True), "```", "",
])


@pytest.fixture(scope="module")
def registered(tracking, tmp_path_factory, make_head_dir):
    """Version 1 trained for a hub target (the champion), version 2 for a local path."""
    name = "peagle-pull-tests"
    with Tracker(tracking, "pull-tests") as tracker:
        for seed, target in ((1, "org/tiny-target"), (2, "/srv/train-box/targets/tiny")):
            head = make_head_dir(tmp_path_factory.mktemp("heads") / f"head-{seed}", seed=seed)
            (head / "README.md").write_text(EXPORTED_CARD)
            register_head(tracker, tracker.run_id, head, name, tags={TAG_TARGET: target}, metrics={})
        assert promote_if_better(tracker, name, "1", 2.0, 0.0, validated=True).promoted
        yield tracker, name


def test_uri_forms(registered):
    tracker, name = registered
    assert str(resolve_model_uri(tracker, f"models:/{name}@champion").version) == "1"
    assert str(resolve_model_uri(tracker, f"models:/{name}/2").version) == "2"
    with pytest.raises(ValueError, match=r"models:/<name>@<alias>.*models:/<name>/<version>"):
        resolve_model_uri(tracker, f"runs:/abc/heads/{name}")
    with pytest.raises(LookupError, match="no such model version"):
        resolve_model_uri(tracker, f"models:/{name}@nobody")
    with pytest.raises(LookupError, match="no such model version"):
        resolve_model_uri(tracker, f"models:/{name}/99")


def test_pull_names_the_recorded_hub_target_and_the_pulled_dir(registered, tmp_path):
    tracker, name = registered
    pulled = pull_head(tracker, f"models:/{name}@champion", tmp_path / "here")
    card = (tmp_path / "here" / "README.md").read_text()
    assert (pulled.version, pulled.target_ref) == ("1", "org/tiny-target")
    line = read_serve_line(card)
    assert (line.target_ref, line.head_ref, line.k, line.parallel_drafting) == (
        "org/tiny-target", str(tmp_path / "here"), 4, True)
    assert line.served_name == name  # clients ask for the head by its registered name
    assert f"--served-model-name {name} " in pulled.serve_line
    assert pulled.serve_line == line.command()
    assert "base_model: org/tiny-target" in card


def test_pull_never_names_the_training_machines_target_path(registered, tmp_path):
    tracker, name = registered
    with pytest.raises(ValueError, match="not a hub id; pass --target"):
        pull_head(tracker, f"models:/{name}/2", tmp_path / "there")
    assert not (tmp_path / "there").exists()  # refused before downloading anything

    local_target = tmp_path / "my-target"
    local_target.mkdir()
    pull_head(tracker, f"models:/{name}/2", tmp_path / "there", target=str(local_target))
    line = read_serve_line((tmp_path / "there" / "README.md").read_text())
    assert (line.target_ref, line.head_ref) == (str(local_target), str(tmp_path / "there"))
    assert "/srv/train-box" not in (tmp_path / "there" / "README.md").read_text()


@pytest.mark.slow
def test_pull_from_a_sqlite_store_that_does_not_exist_is_refused_and_creates_none(registered, tmp_path, mlflow_uri):
    """A mistyped store: MLflow would create an empty database there and say "no such model version"."""
    from tests.peagle_cli import assert_refused, peagle

    _, name = registered
    store = mlflow_uri.removeprefix("sqlite:///")  # the session's store, an absolute path
    relative = f"sqlite:///{store.lstrip('/')}"  # three slashes: relative to the working directory
    result = peagle("pull", f"models:/{name}@champion", tmp_path / "out", "--tracking-uri", relative, cwd=tmp_path)
    assert_refused(result, f"MLflow tracking URI {relative}: no database at {tmp_path / store.lstrip('/')}",
                   f"did you mean {mlflow_uri}?")
    missing = tmp_path / "mlfow.db"
    result = peagle("pull", f"models:/{name}@champion", tmp_path / "out", env={"MLFLOW_TRACKING_URI": f"sqlite:///{missing}"})
    assert_refused(result, f"no database at {missing} (a read never creates one)", "MLFLOW_TRACKING_URI")
    assert not missing.exists() and not (tmp_path / "out").exists() and not (tmp_path / "tmp").exists()
