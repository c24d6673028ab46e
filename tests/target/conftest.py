"""A tiny embedded-target build shared by the fast tests (seconds, not minutes)."""

import os

import pytest

from peagle.config import EmbeddedTargetRecipe

TINY_RECIPE = EmbeddedTargetRecipe(
    vocab_size=512,
    hidden_size=64,
    num_layers=8,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=128,
    max_position_embeddings=256,
    seq_len=64,
    batch_size=8,
    train_steps=80,
    learning_rate=1e-2,
    corpus_max_bytes=300_000,
    heldout_fraction=0.1,
)


@pytest.fixture(scope="session")
def tiny_home(tmp_path_factory):
    """A throwaway PEAGLE_HOME, so the tiny build never touches the real cache."""
    return tmp_path_factory.mktemp("peagle-home")


@pytest.fixture
def in_home(tiny_home, monkeypatch):
    monkeypatch.setenv("PEAGLE_HOME", str(tiny_home))
    return tiny_home


@pytest.fixture(scope="session")
def tiny_target(tiny_home):
    """The tiny recipe built once per session into ``tiny_home``."""
    from peagle.testing.embedded import build_embedded_target

    old = os.environ.get("PEAGLE_HOME")
    os.environ["PEAGLE_HOME"] = str(tiny_home)
    try:
        return build_embedded_target(TINY_RECIPE, progress=False)
    finally:
        if old is None:
            os.environ.pop("PEAGLE_HOME")
        else:
            os.environ["PEAGLE_HOME"] = old
