"""Bad input through the real CLI: each mistake is refused with exit code 2 and a message (no
traceback) naming the file or key and the fix, before any work starts."""

import json
from pathlib import Path

import pytest

from tests.peagle_cli import Result, assert_refused, peagle
from tests.support.conversations import CONVERSATIONS

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "configs" / "tiny.yaml"

MINIMAL = """\
name: bad-input
target: {model: embedded}
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
    path = config_file(tmp_path, MINIMAL + "train:\n  recipe: {epochs: 3}\neval:\n  ks: [3]\ntrain:\n  peagle: {k_train: 4}\n")
    assert_refused(check(path), f"{path}:11: train is given twice (first on line 7)", "keep one train")


@pytest.mark.parametrize("text, key, lines", [
    (MINIMAL + "train:\n  recipe:\n    epochs: 3\n    seed: 1\n    epochs: 5\n", "train.recipe.epochs", (11, 9)),
    (MINIMAL + "      weight: 1\n      weight: 2\n", "data.sources[0].weight", (8, 7)),
    (MINIMAL + "tracking:\n  wandb:\n    mode: offline\n    mode: online\n", "tracking.wandb.mode", (10, 9)),
])
def test_a_key_given_twice_at_any_depth_is_refused(tmp_path, text, key, lines):
    path = config_file(tmp_path, text)
    line, first = lines
    assert_refused(check(path), f"{path}:{line}: {key} is given twice (first on line {first})")


def test_a_merge_may_override_the_keys_it_brings(tmp_path):
    merged = config_file(tmp_path, "name: merged\ntarget: {model: embedded}\n"  # a merge (<<: *anchor) is not a key given twice
                                   "data:\n  sources:\n    - &src {kind: jsonl, path: data/prompts/code_train.jsonl}\n"
                                   "    - <<: *src\n      weight: 2\n")
    result = check(merged)
    assert result.returncode == 0 and "valid" in result, result.output


@pytest.mark.parametrize("yes", ["yes", "on", "true"])
def test_a_yaml_boolean_is_not_a_number_in_a_file(tmp_path, yes):
    path = config_file(tmp_path, MINIMAL + f"train:\n  recipe: {{epochs: {yes}}}\n")
    assert_refused(check(path), "train.recipe.epochs", "a boolean where a number is wanted", "write the number")


@pytest.mark.parametrize("pair, key", [
    ("train.recipe.epochs=yes", "train.recipe.epochs"),
    ("train.launch.zero_stage=off", "train.launch.zero_stage"),  # a Literal of numbers
    ("eval.ks=[3, yes]", "eval.ks"),  # inside a list
    ("tracking.benchmark_weights={code: on}", "tracking.benchmark_weights"),  # inside a mapping
])
def test_a_yaml_boolean_is_not_a_number_in_a_set(pair, key):
    assert_refused(check(DEMO, "--set", pair), key, "a boolean where a number is wanted")


def test_a_boolean_key_still_takes_a_yaml_boolean_in_a_set():
    result = check(DEMO, "--set", "train.baseline.eagle3=no")
    assert result.returncode == 0 and "valid" in result, result.output


@pytest.mark.parametrize("where, key", [
    ("file", "train.recipe.learning_rate"),
    ("--set", "tracking.benchmark_weights.code"),
    ("--set", "train.recipe.max_train_seconds"),
])
def test_infinite_and_nan_numbers_are_refused(tmp_path, where, key):
    if where == "file":
        result = check(config_file(tmp_path, MINIMAL + "train:\n  recipe: {learning_rate: .inf}\n"))
    else:
        result = check(DEMO, "--set", f"{key}=.nan" if "weights" in key else f"{key}=.inf")
    assert_refused(result, key, "is not a finite number", "write a finite value")


# ----------------------------------------------------------------------------- choices that cannot be right


def test_eval_ks_beyond_what_p_eagle_trains_is_refused():
    assert_refused(check(DEMO, "--set", "eval.ks=[3, 5, 7]"),
                   "eval.ks [3, 5, 7]: K = 7 is beyond the 5 draft positions a P-EAGLE head trains (train.peagle.k_train = 5)",
                   "lower eval.ks to at most 5 or raise train.peagle.k_train to 7")


@pytest.mark.slow
def test_eval_num_prompts_beyond_the_prompt_set_is_refused():
    prompts = REPO / "data" / "prompts" / "code_eval.jsonl"
    assert_refused(check(DEMO, "--set", "eval.num_prompts=65"),
                   f"eval.num_prompts = 65, but eval.prompts ({prompts}) holds 64 prompts",
                   "lower eval.num_prompts to at most 64")


@pytest.mark.parametrize("key", ["eval.prompts", "eval.completion_prompts"])
@pytest.mark.slow
def test_a_missing_eval_prompt_file_is_refused(tmp_path, key):
    missing = tmp_path / "nope.jsonl"
    assert_refused(check(DEMO, "--set", f"{key}={missing}"),
                   f"{key}: '{missing}' is neither a file", f"fix {key}")


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_stage_command_refuses_before_building_the_target(tmp_path):
    """`peagle data` with an eval set too short: refused before the embedded target is built."""
    home = tmp_path / "home"
    result = peagle("data", DEMO, "--set", "eval.num_prompts=65", env={"PEAGLE_HOME": str(home)})
    assert_refused(result, "eval.num_prompts = 65", "holds 64 prompts")
    assert not (home / "targets").exists()


@pytest.mark.slow
def test_muon_on_a_cpu_without_a_compiler_is_refused_before_the_data_stage(tmp_path):
    """The default optimizer compiles its update: `peagle run` on a machine without g++ or clang++
    says so before the data stage, not when training starts after it."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the check is for CPU machines")
    home, empty = tmp_path / "home", tmp_path / "bin"
    empty.mkdir()
    result = peagle("run", DEMO, "--set", "train.recipe.optimizer=muon",
                    env={"PEAGLE_HOME": str(home), "PATH": str(empty), "CXX": ""})
    assert_refused(result, "train.recipe.optimizer: muon", "needs a C++ compiler", "train.recipe.optimizer: adamw")
    assert not (home / "targets").exists()


# ----------------------------------------------------------------------------- what a config names


EVAL_PROMPTS = ["Reverse a list in place.", "Sum the digits of a number."]


@pytest.fixture(scope="module")
def local_target(tmp_path_factory):
    """A tiny random Llama in a local directory (its tokenizer has a `<|mask|>` special token)."""
    from peagle.testing.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("checked") / "target", num_layers=8)


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def target_config(tmp_path, target: Path, *, sources: str | None = None) -> Path:
    """A config of ``target`` whose every input is a file under ``tmp_path``: 8 training prompts,
    2 of them held out, and an evaluation set of 2 other prompts."""
    prompts = jsonl(tmp_path / "prompts.jsonl", [{"messages": m} for m in CONVERSATIONS])
    eval_set = jsonl(tmp_path / "eval.jsonl", [{"prompt": p} for p in EVAL_PROMPTS])
    return config_file(tmp_path, f"""\
name: checked
workdir: {tmp_path / "run"}
target: {{model: {target}, dtype: float32, mask_token: "<|mask|>"}}
vllm: {{max_model_len: 192, max_num_seqs: 8, cpu_kvcache_space_gib: 1}}
data:
  sources: {sources or f"[{{kind: jsonl, path: {prompts}}}]"}
  heldout_samples: 2
  max_seq_len: 64
  regenerate: {{enabled: false}}
  draft_vocab_size: 64
train: {{recipe: {{max_len: 64}}, peagle: {{k_train: 5}}}}
eval: {{max_tokens: 16, prompts: {eval_set}, num_prompts: 2, ks: [3]}}
""")


def check_here(*args) -> Result:
    """`peagle config check` in this process (typer's runner): the same command as ``check``'s,
    without a Python start (and torch's and transformers' imports) per case."""
    from typer.testing import CliRunner

    from peagle.cli import app

    done = CliRunner().invoke(app, ["config", "check", *map(str, args)])
    assert done.exception is None or isinstance(done.exception, SystemExit), repr(done.exception)
    return Result(done.exit_code, " ".join(done.output.split()))


def test_a_config_whose_inputs_all_check_is_valid_and_its_plan_is_printed(tmp_path, local_target):
    result = check_here(target_config(tmp_path, local_target))
    assert result.returncode == 0 and "valid" in result and "not checked here" not in result, result.output
    assert not (tmp_path / "run").exists()  # nothing written
    for line in ("plan: samples: at most 8 (6 to train on), each at most 64 tokens: at most 512 tokens",
                 "plan: hidden states: 4 layers x 128 a token",
                 "plan: stored (data.hidden_states: stored):", "in bfloat16", "in float8",
                 "plan: streamed (data.hidden_states: streamed):", "plan: disk:"):
        assert line in result, (line, result.output)
    assert "plan: training:" not in result  # a CPU config: no GPU hours
    gpu = check_here(target_config(tmp_path, local_target), "--set", "train.recipe.precision=bf16")
    assert gpu.returncode == 0 and "plan: training: GPU hours not estimated" in gpu, gpu.output  # not the GPU recipe


def test_a_stored_dataset_the_disk_cannot_hold_is_refused_naming_streaming(tmp_path, local_target, small_disk):
    """8 prompts of up to 64 tokens x 4 layers x 128 in bf16 is ~530 KB: on a 256 KiB disk config check
    refuses it before any work, naming data.hidden_states: streamed, which fits (tokens, held-out
    states and a 50 KiB spool)."""
    disk = small_disk(256 << 10)
    config = target_config(tmp_path, local_target)
    where = ("--set", f"workdir={disk.path / 'run'}")
    assert_refused(check_here(config, *where), "a stored dataset of this config takes up to",
                   "8 samples of up to 64 tokens", "set data.hidden_states: streamed")
    streamed = check_here(config, *where, "--set", "data.hidden_states=streamed", "--set", "data.spool_gib=0.00005")
    assert streamed.returncode == 0 and "valid" in streamed, streamed.output
    assert "this config (streamed) needs at most" in streamed


@pytest.mark.slow
def test_the_command_refuses_a_target_it_cannot_have(tmp_path, local_target):
    """The same through `peagle` itself: exit 2, one message, no traceback."""
    assert_refused(check(target_config(tmp_path, local_target), "--set", "target.model=peagle-test/not-cached"),
                   "target.model 'peagle-test/not-cached' is not in the Hugging Face cache", "`hf download")


def bad_inputs(tmp_path: Path, target: Path) -> dict:
    """Each mistake a config can hold about what it names: (--set overrides, what the refusal says)."""
    prompts = tmp_path / "prompts.jsonl"
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n" + '{"messages": [{"role": "user", \n')
    missing = tmp_path / "no-such-prompts.jsonl"
    leaked = jsonl(tmp_path / "leaked.jsonl", [{"prompt": "Write a stack class."}, {"prompt": EVAL_PROMPTS[0]}])
    return {
        "target path missing": ([f"target.model={tmp_path / 'no-such-model'}"],
                                [f"target.model '{tmp_path / 'no-such-model'}' looks like a local path but does not "
                                 "exist"]),
        "hub id not cached": (["target.model=peagle-test/not-in-the-cache"],
                              ["target.model 'peagle-test/not-in-the-cache' is not in the Hugging Face cache",
                               "HF_HUB_OFFLINE=1", "`hf download peagle-test/not-in-the-cache`",
                               "point target.model at a local directory"]),
        "mask token not a token": (["target.mask_token=<|no-such-token|>"],
                                   ["target.mask_token '<|no-such-token|>' is not a token of", "target.mask_token_id"]),
        "mask token in the prompts": (["target.mask_token=self"],
                                      ["target.mask_token 'self'", "is a token the target produces in ordinary text",
                                       "prompts of data.sources", "set target.mask_token to a reserved or unused"]),
        "draft vocabulary beyond the target's": (["data.draft_vocab_size=100000"],
                                                 ["data.draft_vocab_size=100000 must be in [2, 384]"]),
        "held-out count beyond the prompts": (["data.heldout_samples=8"],
                                              ["data.heldout_samples=8 leaves no training samples out of 8 prompts"]),
        "train.recipe.max_samples beyond the prompts": (["train.recipe.max_samples=7"],
                                                 ["train.recipe.max_samples=7 is more than the data can hold: 8 prompts less "
                                                  "data.heldout_samples=2 leave at most 6 answers"]),
        "prompt file not valid JSONL": ([f"data.sources=[{{kind: jsonl, path: {broken}}}]"],
                                        [f"data.sources[0] (jsonl:{broken}): {broken} cannot be read as jsonl: line 2 "
                                         "of broken.jsonl is not JSON", "fix the file or data.sources[0].path"]),
        "local source missing": ([f"data.sources=[{{kind: jsonl, path: {prompts}}}, {{kind: jsonl, path: {missing}}}]"],
                                 [f"data.sources[1] (jsonl:{missing}): file not found: {missing}",
                                  "fix data.sources[1].path"]),
        "eval prompt set missing": ([f"eval.prompts=[{tmp_path / 'no-such-eval.jsonl'}]"],
                                    [f"eval.prompts: '{tmp_path / 'no-such-eval.jsonl'}' is neither a file",
                                     "fix eval.prompts"]),
        "eval prompts among the training prompts": ([f"eval.prompts=[{leaked}]"],
                                                     ["evaluation prompts also appear in the training prompts",
                                                      "1 of 2 prompts of eval set 'leaked'"]),
        "output folder not writable": (["workdir=/proc/peagle-run"],  # /proc takes no file, not even root's
                                       ["workdir: /proc/peagle-run cannot be written", "set workdir to a directory"]),
    }


BAD_INPUTS = ["target path missing", "hub id not cached", "mask token not a token", "mask token in the prompts",
              "draft vocabulary beyond the target's", "held-out count beyond the prompts",
              "train.recipe.max_samples beyond the prompts", "prompt file not valid JSONL", "local source missing",
              "eval prompt set missing", "eval prompts among the training prompts", "output folder not writable"]


@pytest.mark.parametrize("mistake", BAD_INPUTS)
def test_config_check_refuses_what_the_data_stage_would(tmp_path, local_target, mistake):
    overrides, says = bad_inputs(tmp_path, local_target)[mistake]
    config = target_config(tmp_path, local_target)
    assert_refused(check_here(config, *(arg for o in overrides for arg in ("--set", o))), *says)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("mistake", ["mask token in the prompts", "held-out count beyond the prompts",
                                     "prompt file not valid JSONL", "eval prompts among the training prompts"])
def test_the_data_stage_refuses_the_same_way(tmp_path, local_target, mistake):
    """`peagle data` runs the checks `config check` runs (peagle.data.preflight), before any engine."""
    overrides, says = bad_inputs(tmp_path, local_target)[mistake]
    config = target_config(tmp_path, local_target)
    result = peagle("data", config, *(arg for o in overrides for arg in ("--set", o)),
                    env={"PEAGLE_HOME": str(tmp_path / "home")})
    assert_refused(result, *says)
    assert not (tmp_path / "run" / "data" / "splits").exists()


def test_a_magpie_file_not_written_yet_counts_as_its_requests(tmp_path, local_target):
    prompts = jsonl(tmp_path / "prompts.jsonl", [{"messages": m} for m in CONVERSATIONS])
    magpie = tmp_path / "magpie.jsonl"
    sources = f"[{{kind: jsonl, path: {prompts}}}, {{kind: magpie, path: {magpie}, max_samples: 4}}]"
    config = target_config(tmp_path, local_target, sources=sources)
    result = check_here(config, "--set", "data.heldout_samples=11")
    assert result.returncode == 0, result.output
    assert f"not checked here: magpie:{magpie}: written by the target in the data stage (4 requests)" in result
    assert_refused(check_here(config, "--set", "data.heldout_samples=12"),
                   "data.heldout_samples=12 leaves no training samples out of 12 prompts")
    assert not magpie.exists()
