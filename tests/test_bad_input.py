"""Bad input through the real CLI: each mistake is refused with exit code 2 and a message (no
traceback) naming the file or key and the fix, before any work starts."""

from pathlib import Path

import pytest

from tests.peagle_cli import Result, assert_refused, peagle

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "configs" / "tiny.yaml"

MINIMAL = """\
name: bad-input
data:
  sources:
    - kind: jsonl
      path: data/prompts/code_train.jsonl
"""


def config_file(tmp_path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def check(*args) -> Result:
    return peagle("config", "check", *args)


# ----------------------------------------------------------------------------- the YAML itself


def test_a_second_section_of_the_same_name_is_refused_naming_both_lines(tmp_path):
    path = config_file(tmp_path, MINIMAL + "train:\n  epochs: 3\neval:\n  ks: [3]\ntrain:\n  k_train: 4\n")
    assert_refused(check(path), f"{path}:10: train is given twice (first on line 6)", "keep one train")


@pytest.mark.parametrize("text, key, lines", [
    (MINIMAL + "train:\n  epochs: 3\n  seed: 1\n  epochs: 5\n", "train.epochs", (9, 7)),
    (MINIMAL + "      weight: 1\n      weight: 2\n", "data.sources[0].weight", (7, 6)),
    (MINIMAL + "tracking:\n  wandb:\n    mode: offline\n    mode: online\n", "tracking.wandb.mode", (9, 8)),
])
def test_a_key_given_twice_at_any_depth_is_refused(tmp_path, text, key, lines):
    path = config_file(tmp_path, text)
    line, first = lines
    assert_refused(check(path), f"{path}:{line}: {key} is given twice (first on line {first})")
    merged = config_file(tmp_path, "name: merged\n"  # a merge (<<: *anchor) may override the keys it brings
                                   "data:\n  sources:\n    - &src {kind: jsonl, path: data/prompts/code_train.jsonl}\n"
                                   "    - <<: *src\n      weight: 2\n")
    result = check(merged)
    assert result.returncode == 0 and "valid" in result, result.output


@pytest.mark.parametrize("yes", ["yes", "on", "true"])
def test_a_yaml_boolean_is_not_a_number_in_a_file(tmp_path, yes):
    path = config_file(tmp_path, MINIMAL + f"train:\n  epochs: {yes}\n")
    assert_refused(check(path), "train.epochs", "a boolean where a number is wanted", "write the number")


@pytest.mark.parametrize("pair, key", [
    ("train.epochs=yes", "train.epochs"),
    ("train.zero_stage=off", "train.zero_stage"),  # a Literal of numbers
    ("eval.ks=[3, yes]", "eval.ks"),  # inside a list
    ("tracking.benchmark_weights={code: on}", "tracking.benchmark_weights"),  # inside a mapping
])
def test_a_yaml_boolean_is_not_a_number_in_a_set(pair, key):
    assert_refused(check(DEMO, "--set", pair), key, "a boolean where a number is wanted")
    assert check(DEMO, "--set", "train.eagle3_baseline=no").returncode == 0  # a boolean key still takes one


@pytest.mark.parametrize("where, key", [
    ("file", "train.learning_rate"),
    ("--set", "tracking.benchmark_weights.code"),
    ("--set", "train.max_train_seconds"),
])
def test_infinite_and_nan_numbers_are_refused(tmp_path, where, key):
    if where == "file":
        result = check(config_file(tmp_path, MINIMAL + "train:\n  learning_rate: .inf\n"))
    else:
        result = check(DEMO, "--set", f"{key}=.nan" if "weights" in key else f"{key}=.inf")
    assert_refused(result, key, "is not a finite number", "write a finite value")


# ----------------------------------------------------------------------------- choices that cannot be right


def test_eval_ks_beyond_what_p_eagle_trains_is_refused():
    assert_refused(check(DEMO, "--set", "eval.ks=[3, 5, 7]"),
                   "eval.ks [3, 5, 7]: K = 7 is beyond the 5 draft positions a P-EAGLE head trains (train.k_train = 5)",
                   "lower eval.ks to at most 5 or raise train.k_train to 7")


def test_eval_num_prompts_beyond_the_prompt_set_is_refused():
    prompts = REPO / "data" / "prompts" / "code_eval.jsonl"
    assert_refused(check(DEMO, "--set", "eval.num_prompts=65"),
                   f"eval.num_prompts = 65, but eval.prompts ({prompts}) holds 64 prompts",
                   "lower eval.num_prompts to at most 64")


@pytest.mark.parametrize("key", ["eval.prompts", "eval.completion_prompts"])
def test_a_missing_eval_prompt_file_is_refused(tmp_path, key):
    missing = tmp_path / "nope.jsonl"
    assert_refused(check(DEMO, "--set", f"{key}={missing}"),
                   f"{key}: '{missing}' is neither a file", f"fix {key}")


def test_a_malformed_eval_prompt_file_names_the_line(tmp_path):
    bad = tmp_path / "eval.jsonl"
    bad.write_text('{"prompt": "hi"}\n{"oops": 1}\n')
    assert_refused(check(DEMO, "--set", f"eval.prompts={bad}", "--set", "eval.num_prompts=1"),
                   f"eval.prompts: {bad}:2: needs a 'messages' list")


def test_a_workdir_that_is_a_file_is_refused(tmp_path):
    afile = tmp_path / "run"
    afile.write_text("not a directory")
    for workdir in (afile, afile / "below"):
        assert_refused(check(DEMO, "--set", f"workdir={workdir}"),
                       "workdir", f"{afile} is a file, not a directory", "set workdir to a directory")


def test_a_stage_command_refuses_before_building_the_target(tmp_path):
    """`peagle data` with an eval set too short: refused before the embedded target is built."""
    home = tmp_path / "home"
    result = peagle("data", DEMO, "--set", "eval.num_prompts=65", env={"PEAGLE_HOME": str(home)})
    assert_refused(result, "eval.num_prompts = 65", "holds 64 prompts")
    assert not (home / "targets").exists()


def test_muon_on_a_cpu_without_a_compiler_is_refused_before_the_data_stage(tmp_path):
    """The default optimizer compiles its update: `peagle run` on a machine without g++ or clang++
    says so before the data stage, not when training starts after it."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the check is for CPU machines")
    home, empty = tmp_path / "home", tmp_path / "bin"
    empty.mkdir()
    result = peagle("run", DEMO, "--set", "train.optimizer=muon",
                    env={"PEAGLE_HOME": str(home), "PATH": str(empty), "CXX": ""})
    assert_refused(result, "train.optimizer: muon", "needs a C++ compiler", "train.optimizer: adamw")
    assert not (home / "targets").exists()
