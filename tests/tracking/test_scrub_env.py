"""The shell's working directory is not a secret, whatever its variable is called."""

from peagle.tracking.scrub import scrub_text


def test_working_directory_is_not_masked(monkeypatch):
    monkeypatch.setenv("PWD", "/srv/project")
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnopqrstu")
    text = "sqlite:////srv/project/.peagle/mlflow.db token hf_abcdefghijklmnopqrstu"
    assert scrub_text(text) == "sqlite:////srv/project/.peagle/mlflow.db token ***"
