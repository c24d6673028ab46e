"""Suite-wide set-up: offline libraries, an isolated Prefect home, shared targets.

The suite must not use or write the machine's own Prefect profile, API or stores: Prefect
gets a throw-away home (its settings are read at import, so before anything imports it).
Library caches (HF, vLLM) stay where the libraries keep them; peagle's outputs go under
PEAGLE_HOME as for users.
"""

import os
import shutil
import tempfile
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

from peagle.paths import configure_environment  # noqa: E402

configure_environment()


def pytest_unconfigure(config):
    shutil.rmtree(_PREFECT_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def embedded_target():
    """The trained embedded default target (built once, cached under .peagle/targets)."""
    from peagle.config import EmbeddedTargetRecipe
    from peagle.target import build_embedded_target

    return build_embedded_target(EmbeddedTargetRecipe(), progress=False)
