"""One SQLite MLflow store for the whole tracking test session (creating one costs ~2 s), and a
real ``mlflow server`` over HTTP for the tests about tracking servers and registry consumers."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from peagle.config import TrackingConfig, load_config
from tests.mlflow_server import mlflow_server as start_mlflow_server
from tests.processes import free_port as _free_port


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture(scope="session")
def tracking(mlflow_uri) -> TrackingConfig:
    return TrackingConfig(tracking_uri=mlflow_uri)


@pytest.fixture()
def pipeline_cfg(mlflow_uri):
    return load_config("configs/tiny.yaml", {"tracking.tracking_uri": mlflow_uri})


@pytest.fixture(scope="session")
def make_head_dir():
    return _make_head_dir


def _make_head_dir(path, seed: int = 0, hidden: int = 8):
    """A small head directory in vLLM's layout (the registry only moves bytes around)."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "seed": seed}))
    save_file(
        {"fc.weight": rng.standard_normal((hidden, 3 * hidden)).astype(np.float32),
         "norm.weight": np.ones(hidden, dtype=np.float32)},
        str(path / "model.safetensors"),
    )
    (path / "README.md").write_text(f"# head {seed}\n")
    return path


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    return _free_port()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """The URI of a real ``mlflow server`` (SQLite backend, proxied artifacts), stopped afterwards."""
    with start_mlflow_server(tmp_path_factory.mktemp("mlflow-server")) as uri:
        yield uri
