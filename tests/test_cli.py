"""The CLI refuses bad configs before any work starts, naming the key."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from peagle.cli import app

REPO = Path(__file__).resolve().parent.parent
runner = CliRunner()


def test_config_check_accepts_the_demo():
    result = runner.invoke(app, ["config", "check", str(REPO / "configs" / "tiny.yaml")])
    assert result.exit_code == 0, result.output
    assert "valid" in result.output


def test_bad_override_fails_with_the_key_before_running():
    result = runner.invoke(app, ["run", str(REPO / "configs" / "tiny.yaml"), "--set", "train.peagle.k_train=0"])
    assert result.exit_code == 2
    assert "train.peagle.k_train" in result.output


def test_unknown_key_in_a_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "configs" / "tiny.yaml").read_text() + "\nlearning_rate: 1.0\n")
    result = runner.invoke(app, ["data", str(bad)])
    assert result.exit_code == 2
    assert "learning_rate" in result.output and "unknown key" in result.output


def test_set_is_parsed_once_for_every_command():
    ok = runner.invoke(app, ["config", "check", str(REPO / "configs" / "tiny.yaml"), "--set", "workdir=/tmp/peagle-x"])
    assert ok.exit_code == 0 and "/tmp/peagle-x" in ok.output, ok.output
    bad = runner.invoke(app, ["config", "check", str(REPO / "configs" / "tiny.yaml"), "--set", "train.recipe.epochs"])
    assert bad.exit_code == 2 and "expected KEY=VALUE" in bad.output
    deep = runner.invoke(app, ["config", "check", str(REPO / "configs" / "tiny.yaml"), "--set", "train.recipe.epochs.x=1"])
    assert deep.exit_code == 2 and "train.recipe.epochs is a value" in deep.output


def test_train_without_a_dataset_says_so_before_any_work(tmp_path):
    """No target is resolved, no rank started: the missing dataset and the command that builds it."""
    import time

    started = time.monotonic()
    result = runner.invoke(app, ["train", str(REPO / "configs" / "tiny.yaml"), "--set", f"workdir={tmp_path}"])
    assert result.exit_code == 2, result.output
    assert f"no usable dataset in {tmp_path}" in result.output and "peagle data CONFIG" in result.output
    assert time.monotonic() - started < 30
    assert not any(tmp_path.rglob("checkpoints"))


def test_data_verify_without_a_dataset(tmp_path):
    result = runner.invoke(app, ["data", str(REPO / "configs" / "tiny.yaml"), "--set", f"workdir={tmp_path}",
                                 "--verify"])
    assert result.exit_code == 2 and "no dataset in" in result.output and "peagle data CONFIG" in result.output


def test_a_stage_result_prints_as_json_a_script_can_read_however_long_its_paths(monkeypatch):
    """Piped output is 120 columns wide: a long run directory must not wrap inside a JSON string."""
    import io
    import json

    from rich.console import Console

    import peagle.cli

    out = io.StringIO()
    monkeypatch.setattr(peagle.cli, "console", Console(file=out, width=40))
    result = {"last_checkpoint": "/tmp/" + "a-long-run-directory/" * 12 + "step-000144", "samples": [48, 7],
              "note": "[red]not markup[/red]"}
    peagle.cli.print_result(result)
    assert json.loads(out.getvalue()) == result


def test_produce_is_refused_where_the_launcher_extracts():
    """`peagle produce` serves a training whose config says data.producer: separate; any other is
    refused before an engine starts, saying how to set it for both commands."""
    result = runner.invoke(app, ["produce", str(REPO / "configs" / "tiny.yaml"), "--set", "data.hidden_states=streamed"])
    assert result.exit_code == 2
    assert "data.producer is launcher" in " ".join(result.output.split()) and "separate" in result.output


@pytest.mark.slow  # a fresh process that loads transformers
def test_the_peagle_command_loads_models_without_scikit_learn():
    """transformers imports scikit-learn with any model class where it is installed (MLflow
    installs it); no command uses it, so ``peagle`` marks it absent before a command runs."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import sys
        from peagle.cli import main
        sys.argv = ["peagle", "--help"]
        try:
            main()
        except SystemExit as done:
            assert done.code == 0, done.code
        from transformers import LlamaForCausalLM
        print(sys.modules["sklearn"] is None)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines()[-1] == "True", done.stdout[-2000:]
