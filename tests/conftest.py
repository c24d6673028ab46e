"""Suite-wide set-up: offline libraries, an isolated Prefect home, and the expensive things
built once per test run and shared: the embedded target, the golden head, one Prefect server
and ONE pipeline run (the flows, tracking and end-to-end tests all read it), tracked by a real
``mlflow server`` over HTTP as teams run it.

The suite must not use or write the machine's own Prefect profile, API or stores: Prefect
gets a throw-away home (its settings are read at import, so before anything imports it), and
no ephemeral server: a test that needs a Prefect API asks for the session's one real server
(the ``prefect_server`` fixture); one that forgets fails with "No Prefect API URL provided"
instead of quietly starting a server of its own.
Library caches (HF, vLLM) stay where the libraries keep them; peagle's outputs go under
PEAGLE_HOME as for users.
"""

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

_PREFECT_HOME = Path(tempfile.mkdtemp(prefix="peagle-tests-prefect-"))
for _var in ("PREFECT_API_URL", "PREFECT_API_KEY", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH"):
    os.environ.pop(_var, None)  # the developer's own Prefect server or Cloud workspace
os.environ["PREFECT_HOME"] = str(_PREFECT_HOME)
os.environ["PREFECT_MEMO_STORE_PATH"] = str(_PREFECT_HOME / "memo_store.toml")  # 3.7 writes ~/.prefect otherwise
os.environ["PREFECT_LOCAL_STORAGE_PATH"] = str(_PREFECT_HOME / "storage")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"  # no network here
os.environ["PREFECT_SERVER_ALLOW_EPHEMERAL_MODE"] = "false"  # only the session's server (CLI subprocesses
# that test Prefect's ephemeral mode start from tests/prefect_server.py:isolated_env, which drops this)

from peagle.paths import configure_environment  # noqa: E402

configure_environment()
import torch  # noqa: E402

# The test process's models are tiny: torch's intra-op threads only wait on each other, and on a
# loaded 2-core runner they spin against other processes (the tiny target of tests/target built
# in 54-73 s with 2 threads, 4-9 s with 1). Subprocesses (vLLM engines, training ranks) are
# unaffected; the embedded target is built with torch's own default, as users build it.
TORCH_DEFAULT_THREADS = torch.get_num_threads()
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parent.parent
TINY_CONFIG = str(REPO / "configs" / "tiny.yaml")
PIPELINE_PROMPTS = 160  # the shared run's prompt file: the first lines of data/prompts/code_train.jsonl


SHIPPED_TARGETS = REPO / "tests" / "support" / "targets"  # the embedded target as built (its README says where)


# This process's pytest config, the tests under way, and the seconds each worker and each worker
# group spent in tests (set-up, call and teardown), for the hooks.
_RUN: dict = {"running": {}, "worker_s": {}, "group_s": {}}


def pytest_configure(config):
    from tests.cores import pin_xdist_worker

    _RUN["config"] = config
    pin_xdist_worker()


def pytest_runtest_logreport(report):
    """Each failure named the moment it happens (with -n, as the worker's report arrives), with its
    duration and first line: a run cut short by a time limit still says what failed and how. Every
    report's seconds count for its worker and its worker group (``pytest_terminal_summary``)."""
    config = _RUN.get("config")
    if config is None or hasattr(config, "workerinput"):
        return
    worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", "")
    for totals, key in ((_RUN["worker_s"], worker or "this process"), (_RUN["group_s"], worker_group(report.nodeid))):
        totals[key] = totals.get(key, 0.0) + report.duration
    if not report.failed:
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", "") or str(report.longrepr or "")
    where = ", ".join(filter(None, [report.when, f"{report.duration:.0f} s", worker]))
    if reporter is not None:
        reporter.write("\n")  # the progress dots of xdist's reports end no line of their own
        reporter.write_line(f"{'FAILED' if report.when == 'call' else 'ERROR'} {report.nodeid} ({where}): "
                            f"{crash.splitlines()[0][:300] if crash else ''}")


def pytest_runtest_logstart(nodeid, location):
    _RUN["running"][nodeid] = time.monotonic()


def pytest_runtest_logfinish(nodeid, location):
    _RUN["running"].pop(nodeid, None)


def pytest_keyboard_interrupt(excinfo):
    """A run stopped (Ctrl-C, or CI's time limit sending it) names the tests it stopped in."""
    config = _RUN.get("config")
    reporter = config and config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or hasattr(config, "workerinput"):
        return
    now = time.monotonic()
    reporter.write("\n")
    for nodeid, started in _RUN["running"].items():
        reporter.write_line(f"STOPPED in {nodeid} after {now - started:.0f} s")


def pytest_terminal_summary(terminalreporter):
    """Each worker's seconds in tests and the heaviest worker groups: the suite lasts as long as its
    busiest worker, so this says whether the scheduler (``heaviest_groups_first``) balanced them."""
    if hasattr(terminalreporter.config, "workerinput") or not _RUN["worker_s"]:
        return
    terminalreporter.write_sep("=", "time in tests by worker and by worker group")
    terminalreporter.write_line("workers: " + ", ".join(f"{w} {s:.0f} s" for w, s in sorted(_RUN["worker_s"].items())))
    heaviest = sorted(_RUN["group_s"].items(), key=lambda kv: -kv[1])[:12]
    terminalreporter.write_line("heaviest groups: " + ", ".join(f"{g} {s:.0f} s" for g, s in heaviest))


@pytest.fixture(autouse=True)
def _all_cores(request):
    """A test marked ``all_cores`` (``tests.cores.needs_cores``) runs with every core of the run."""
    if request.node.get_closest_marker("all_cores") is None:
        yield
        return
    from tests.cores import run_cores

    pinned = os.sched_getaffinity(0)
    os.sched_setaffinity(0, run_cores())
    try:
        yield
    finally:
        os.sched_setaffinity(0, pinned)


def pytest_sessionstart(session):
    """Every process of the run (the suite, the CLIs and engines it starts) finds the embedded
    target built (a run never builds it): the shipped build, else one built now (4 to 20 minutes
    on 2 cores, by the CPU's bf16 support)."""
    from peagle.config import EmbeddedTargetRecipe
    from peagle.testing.embedded import build_embedded_target

    seed_shipped_target()
    build_embedded_target(EmbeddedTargetRecipe(), progress=False)  # the seeded build is reused


def seed_shipped_target() -> None:
    """Copy the shipped build of the default recipe into PEAGLE_HOME/targets when none is there
    (whole or not at all); a recipe without a shipped build is built at the session's start."""
    from peagle.config import EmbeddedTargetRecipe
    from peagle.target.embedded import embedded_target_dir, is_complete

    final = embedded_target_dir(EmbeddedTargetRecipe())
    shipped = SHIPPED_TARGETS / final.name
    if is_complete(final) or not is_complete(shipped):
        return
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.shipped-", dir=final.parent))
    shutil.copytree(shipped, staging, dirs_exist_ok=True)
    try:
        staging.rename(final)
    except OSError:  # another session's process seeded it first
        shutil.rmtree(staging, ignore_errors=True)


def pytest_unconfigure(config):
    shutil.rmtree(_PREFECT_HOME, ignore_errors=True)


# Shared fixtures whose one-time set-up the first test that asks for one pays inside its own time
# limit (pyproject.toml's `timeout`, set-up included, so a hung server or engine still fails the
# suite). Each adds its budget, about three times what it takes on 2 loaded cores, to the limit
# of every test that uses it.
LONG_SETUPS_S = {
    "embedded_target": 1200,  # copied from tests/support when its recipe is shipped; else built, 4-20 minutes
    # one whole pipeline run: data, both heads, evaluation, publish: ~300 s alone, ~1,000 s beside
    # another worker's tests (the EAGLE-3 baseline trains as long as the slowed P-EAGLE head did)
    "pipeline_run": 2400,
    "deployed": 900,  # the same as a Prefect deployment run on a worker (~250 s)
    "extraction": 300,  # a vLLM extraction engine and its hidden states (tests/data/test_extract.py)
    "data_engine": 300,  # the data stage's vLLM engine (tests/data/test_regenerate.py)
    "single_node": 300,  # a training run under torchrun (tests/train/test_multinode.py)
    "zero2_reference": 300,  # a ZeRO-2 training run (tests/train/test_deepspeed.py)
    "imported": 300,  # SmolLM2 imported from its GGUF file (tests/target/test_gguf.py)
    "mlflow_server": 120,  # a real `mlflow server`
}


# `make test` runs the suite on several workers (pytest-xdist): most of a test's time here is
# single-threaded start-up (imports, servers, engines, torchrun) that overlaps well on 2 cores.
# Tests go to the workers in groups (``worker_group``): a module's tests stay on one worker, so its
# module fixtures start once, and the modules that read the one shared pipeline run form one group,
# so it is built once per test run, not once per worker. xdist schedules by node id alone, so the
# group is a rule on the module; collection refuses a reader of the shared run left out of it.
SHARED_RUN_MODULES = frozenset({
    "tests/test_pipeline_e2e.py", "tests/test_readme_commands.py", "tests/flows/test_flows.py",
    "tests/data/test_health.py", "tests/eval/test_offline_predicts_vllm.py",
    "tests/tracking/test_pipeline_in_mlflow.py",
})


def worker_group(nodeid: str) -> str:
    module = nodeid.split("::")[0]
    return "pipeline_run" if module in SHARED_RUN_MODULES else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Whole groups to a worker, in collection order (``heaviest_groups_first``)."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    config.option.loadscopereorder = False  # xdist's reorder by test count would undo ours
    return GroupScheduling(config, log)


def expected_seconds(item) -> float:
    """A rough cost: a third of the test's own time limit where it names one (they are set at about
    three times what the test takes), else a slow test's ~60 s or a fast test's ~1 s."""
    own = item.get_closest_marker("timeout")
    if own and own.args:
        return own.args[0] / 3
    return 60 if "slow" in item.keywords else 1


def heaviest_groups_first(items) -> list:
    """The items grouped, heaviest group first (each group in its own order): a worker that draws
    a long group late would leave the other idle at the end."""
    weight: dict[str, float] = {}
    for item in items:
        group = worker_group(item.nodeid)
        weight[group] = weight.get(group, 0) + expected_seconds(item)
    order = {group: rank for rank, group in enumerate(sorted(weight, key=lambda g: -weight[g]))}
    return sorted(items, key=lambda item: order[worker_group(item.nodeid)])


def refuse_shared_run_readers_outside_its_group(items) -> None:
    for item in items:
        if "pipeline_run" in getattr(item, "fixturenames", ()) and worker_group(item.nodeid) != "pipeline_run":
            raise pytest.UsageError(f"{item.nodeid} reads the shared pipeline run: add its module to "
                                    "SHARED_RUN_MODULES in tests/conftest.py, or each worker builds the run again")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` run where torch sees a CUDA device; elsewhere each is skipped with the
    reason, so the summary counts what this machine could not check. A test using a fixture of
    ``LONG_SETUPS_S`` gets that fixture's budget on top of its time limit (where tests have time
    limits: `make coverage` runs without them). The heaviest worker groups come first."""
    refuse_shared_run_readers_outside_its_group(items)
    timed = config.pluginmanager.has_plugin("timeout")  # not under `make coverage` (-p no:timeout)
    items[:] = heaviest_groups_first(items)
    skip = None if torch.cuda.is_available() else pytest.mark.skip(
        reason="needs a CUDA device (marked gpu); torch sees none here")
    for item in items:
        if skip is not None and "gpu" in item.keywords:
            item.add_marker(skip)
        setup_s = sum(LONG_SETUPS_S.get(name, 0) for name in getattr(item, "fixturenames", ()))
        if setup_s and timed:
            own = item.get_closest_marker("timeout")
            limit = own.args[0] if own and own.args else float(config.getini("timeout") or 0)
            if limit:
                item.add_marker(pytest.mark.timeout(limit + setup_s), append=False)


@pytest.fixture(scope="session")
def embedded_target():
    """The trained embedded default target (built once, cached under .peagle/targets)."""
    from peagle.config import EmbeddedTargetRecipe
    from peagle.testing.embedded import build_embedded_target

    torch.set_num_threads(TORCH_DEFAULT_THREADS)
    try:
        return build_embedded_target(EmbeddedTargetRecipe(), progress=False)
    finally:
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def golden_pair(tmp_path_factory):
    """(marker target, golden head) of ``peagle.testing.golden``, built once for every test."""
    from peagle.testing.golden import build_golden_pair

    return build_golden_pair(tmp_path_factory.mktemp("golden"))


@pytest.fixture(scope="session")
def prefect_server():
    """ONE real ``prefect server start`` for the whole test run (the suite's PREFECT_HOME, a free
    127.0.0.1 port): flows run in this process, the CLIs and the workers tests start all talk to
    it. Stopped at the end of the session, also when tests failed."""
    from tests.prefect_server import prefect_server as start_prefect_server

    with start_prefect_server(_PREFECT_HOME) as server, server.as_default():
        yield server


def code_train_prompt_lines() -> list[str]:
    return (REPO / "data" / "prompts" / "code_train.jsonl").read_text().splitlines()


def pipeline_overrides(tmp: Path, tracking_uri: str) -> dict:
    """tiny.yaml shrunk to fit the CI budget, every code path kept (the EAGLE-3 baseline too),
    on a prompt file of the run's own."""
    return {
        "name": "suite",
        "workdir": str(tmp / "run"),
        "tracking.tracking_uri": tracking_uri,
        "data.sources": [{"kind": "jsonl", "path": str(tmp / "prompts.jsonl"), "schema": "messages"}],
        "data.max_samples": None,
        "data.heldout_samples": 16,
        "data.regenerate.max_tokens": 128,
        "train.recipe.epochs": 1,
        "train.baseline.eagle3": True,
        "train.eagle3.ttt_steps": 3,
        "eval.ks": [3],
        "eval.num_prompts": 8,
        "eval.max_tokens": 64,
    }


@dataclass(frozen=True)
class PipelineRun:
    """The shared pipeline run: what a user would have after ``peagle run`` once."""

    tmp: Path  # prompts.jsonl, run/ and the MLflow server's store (mlflow/) live here
    config: str
    overrides: dict
    result: object  # flows.pipeline.PipelineResult
    seconds: float
    champion_after: str  # the registry's champion version right after the run


@pytest.fixture(scope="session")
def pipeline_tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pipeline")


@pytest.fixture(scope="session")
def pipeline_mlflow(pipeline_tmp):
    """The shared run's tracking server: a real ``mlflow server``, reached over HTTP."""
    from tests.mlflow_server import mlflow_server

    with mlflow_server(pipeline_tmp / "mlflow") as uri:
        yield uri


@pytest.fixture(scope="session")
def pipeline_run(pipeline_tmp, pipeline_mlflow, embedded_target, prefect_server) -> PipelineRun:
    """One real pipeline run (vLLM, DeepSpeed, an MLflow server, Prefect) shared by the whole test run."""
    from mlflow import MlflowClient

    from flows.pipeline import pipeline_flow

    tmp = pipeline_tmp
    (tmp / "prompts.jsonl").write_text("\n".join(code_train_prompt_lines()[:PIPELINE_PROMPTS]) + "\n")
    overrides = pipeline_overrides(tmp, pipeline_mlflow)
    start = time.perf_counter()
    result = pipeline_flow(TINY_CONFIG, overrides)
    seconds = time.perf_counter() - start
    print(f"\nshared pipeline run: {seconds:.1f} s; stages {result.stage_seconds}")
    champion = MlflowClient(tracking_uri=overrides["tracking.tracking_uri"]).get_model_version_by_alias(
        "peagle-embedded", "champion")
    return PipelineRun(tmp, TINY_CONFIG, overrides, result, seconds, str(champion.version))


@dataclass
class SmallDisk:
    """A tmpfs of its own: a real file system that really fills up (ENOSPC)."""

    path: Path

    def resize(self, size: int) -> None:
        """Grow (or shrink) it in place, keeping its files: a user freeing space."""
        import subprocess

        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True, capture_output=True)


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(size_bytes) -> SmallDisk``, unmounted after the test. Needs to mount a tmpfs
    (root, or CAP_SYS_ADMIN); skipped with the reason elsewhere."""
    import subprocess

    mounted = []

    def make(size: int) -> SmallDisk:
        path = tmp_path / f"disk{len(mounted)}"
        path.mkdir()
        try:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                  capture_output=True, text=True)
        except FileNotFoundError:
            pytest.skip("no mount command here to make a small disk")
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here to fill a disk for real: {done.stderr.strip() or done.returncode}")
        mounted.append(path)
        return SmallDisk(path)

    yield make
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
