"""The CLI refuses bad configs before any work starts, naming the key."""

from pathlib import Path

from typer.testing import CliRunner

from peagle.cli import app

REPO = Path(__file__).resolve().parent.parent
runner = CliRunner()


def test_config_check_accepts_the_demo():
    result = runner.invoke(app, ["config", "check", str(REPO / "configs" / "tiny.yaml")])
    assert result.exit_code == 0, result.output
    assert "valid" in result.output


def test_bad_override_fails_with_the_key_before_running():
    result = runner.invoke(app, ["run", str(REPO / "configs" / "tiny.yaml"), "--set", "train.k_train=0"])
    assert result.exit_code == 2
    assert "train.k_train" in result.output


def test_unknown_key_in_a_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "configs" / "tiny.yaml").read_text() + "\nlearning_rate: 1.0\n")
    result = runner.invoke(app, ["data", str(bad)])
    assert result.exit_code == 2
    assert "learning_rate" in result.output and "unknown key" in result.output


def test_set_is_parsed_once_for_every_command():
    ok = runner.invoke(app, ["config", "check", str(REPO / "configs" / "tiny.yaml"), "--set", "workdir=/tmp/peagle-x"])
    assert ok.exit_code == 0 and "/tmp/peagle-x" in ok.output, ok.output
    bad = runner.invoke(app, ["config", "check", str(REPO / "configs" / "tiny.yaml"), "--set", "train.epochs"])
    assert bad.exit_code == 2 and "expected KEY=VALUE" in bad.output
    deep = runner.invoke(app, ["config", "check", str(REPO / "configs" / "tiny.yaml"), "--set", "train.epochs.x=1"])
    assert deep.exit_code == 2 and "train.epochs is a value" in deep.output
