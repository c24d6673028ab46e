"""Each command with each service it needs missing or down: one line naming the service, what is
wrong and how to start it or point at it, exit status 69 (EX_UNAVAILABLE), no traceback, and no
work done first.

The services are really missing here: a Prefect API or an MLflow tracking server at a local port
nothing listens on, vLLM taken out of the interpreter (a ``sitecustomize`` marks it absent in
``sys.modules``, as Python's import system does for a blocked module), and more devices asked
for than the machine has. Matrix (command: services): ``run`` and ``retrain``: Prefect, MLflow,
vLLM, devices; ``deploy``: Prefect; ``pull`` and ``train`` (``train.init_from: champion``):
MLflow; ``data``: vLLM, devices, a GPU; ``export``, ``evaluate``, ``serve``: vLLM.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mlflow_server import free_port
from tests.peagle_cli import Result, peagle

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.yaml"
EXIT_UNAVAILABLE = 69

PREFECT_SAYS = ("does not answer", "start it (`prefect server start`) or point PREFECT_API_URL at a running one")
MLFLOW_SAYS = ("does not answer ([Errno 111] Connection refused)", "start it (`mlflow server",
               "point MLFLOW_TRACKING_URI")
VLLM_SAYS = ("vLLM cannot be imported", "`make install` installs it (EXTRA=gpu on a GPU machine")


def command(name: str, tmp_path: Path) -> list[str]:
    """The command as a user types it, its outputs under ``tmp_path``."""
    run = ["--set", f"workdir={tmp_path / 'run'}"]
    return {
        "run": ["run", TINY, *run],
        "retrain": ["retrain", TINY, *run],
        "deploy": ["deploy"],
        "pull": ["pull", "models:/peagle-tiny@champion", tmp_path / "head"],
        "train": ["train", TINY, *run, "--set", "train.init_from=champion"],
        "data": ["data", TINY, *run],
        "export": ["export", TINY, *run],
        "evaluate": ["evaluate", TINY, *run],
        "serve": ["serve", tmp_path / "head"],
    }[name]


def assert_unavailable(result: Result, *says: str) -> None:
    """Ended by one line holding each of ``says``; exit 69; no traceback."""
    assert result.returncode == EXIT_UNAVAILABLE, result.output
    assert "Traceback" not in result.output, result.output
    for text in says:
        assert text in result.last_line, f"{text!r} not in the last line: {result.last_line!r}\n{result.output}"


def run_without(tmp_path: Path, name: str, *args: str, env: dict | None = None) -> Result:
    result = peagle(*command(name, tmp_path), *args, env={"PEAGLE_HOME": str(tmp_path / "home"), **(env or {})},
                    timeout=300)
    assert not (tmp_path / "run").exists() and not (tmp_path / "head").exists()  # nothing was done
    return result


SLOW = pytest.mark.slow  # over ~15 s on 2 cores: the commands that import vLLM's platform, torch and Prefect first


@pytest.mark.parametrize("name", [pytest.param("run", marks=SLOW), pytest.param("retrain", marks=SLOW), "deploy"])
@pytest.mark.slow
def test_prefect_api_down(tmp_path, name):
    api = f"http://127.0.0.1:{free_port()}/api"
    result = run_without(tmp_path, name, env={"PREFECT_API_URL": api})
    assert_unavailable(result, f"Prefect API {api} does not answer", *PREFECT_SAYS)


@pytest.mark.parametrize("name", [pytest.param("run", marks=SLOW), pytest.param("retrain", marks=SLOW), "pull",
                                  "train"])
def test_mlflow_tracking_server_down(tmp_path, name):
    uri = f"http://127.0.0.1:{free_port()}"
    result = run_without(tmp_path, name, env={"MLFLOW_TRACKING_URI": uri})
    assert_unavailable(result, f"MLflow tracking server {uri} does not answer", *MLFLOW_SAYS)


@pytest.fixture
def without_vllm(tmp_path, monkeypatch):
    """This interpreter, with vLLM absent: ``import vllm`` fails as for a package not installed."""
    blocker = tmp_path / "without-vllm"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text('import sys\nsys.modules["vllm"] = None  # vLLM is not installed\n')
    monkeypatch.setenv("PYTHONPATH", str(blocker))


@pytest.mark.parametrize("name", ["data", pytest.param("export", marks=SLOW), "evaluate", "serve",
                                  pytest.param("run", marks=SLOW), "retrain"])
def test_vllm_missing(tmp_path, without_vllm, name):
    assert_unavailable(run_without(tmp_path, name), *VLLM_SAYS)


@pytest.mark.parametrize("name", [pytest.param(n, marks=SLOW) for n in ("data", "run", "retrain")])
def test_more_devices_than_the_machine_has(tmp_path, name):
    import os

    cores = len(os.sched_getaffinity(0))
    result = run_without(tmp_path, name, "--set", f"vllm.data_parallel_size={cores + 1}")
    assert_unavailable(result, f"needed by vllm.data_parallel_size={cores + 1} x vllm.tensor_parallel_size=1",
                       "run on a machine that has them", "or lower vllm.data_parallel_size")


@pytest.mark.gpu
def test_no_gpu_visible_to_the_gpu_build(tmp_path):
    """vLLM's GPU build with every GPU hidden (CUDA_VISIBLE_DEVICES empty)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        pytest.skip("vLLM here is not its GPU build")
    result = run_without(tmp_path, "data", env={"CUDA_VISIBLE_DEVICES": ""})
    assert_unavailable(result, "1 GPU is needed by vllm.data_parallel_size=1", "0 visible",
                       "CUDA_VISIBLE_DEVICES names the GPUs vLLM may use")
