"""Suite-wide set-up: offline libraries, caches under the project home, shared targets."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

from peagle.paths import configure_environment  # noqa: E402

configure_environment()


@pytest.fixture(scope="session")
def embedded_target():
    """The trained embedded default target (built once, cached under .peagle/targets)."""
    from peagle.config import EmbeddedTargetRecipe
    from peagle.target import build_embedded_target

    return build_embedded_target(EmbeddedTargetRecipe(), progress=False)
