"""A tiny random Llama target (8 layers: aux ids 2, 4, 5) and a random head for it."""

import pytest

from peagle.testing.golden import (
    build_tiny_target,
    draft_vocab_skipping_low_ids,
    random_head_state_dict,
    tiny_head_spec,
)

DRAFT_VOCAB = 128


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    return build_tiny_target(tmp_path_factory.mktemp("export") / "target")


@pytest.fixture(scope="session")
def target_embed(tiny_target):
    from peagle.export.validate import load_target_embedding

    return load_target_embedding(tiny_target)


@pytest.fixture(scope="session")
def spec(tiny_target):
    return tiny_head_spec(tiny_target, draft_vocab_size=DRAFT_VOCAB)


@pytest.fixture(scope="session")
def vocab(spec):
    return draft_vocab_skipping_low_ids(spec.vocab_size, DRAFT_VOCAB, spec.mask_token_id)


@pytest.fixture
def state(spec):
    return random_head_state_dict(spec, seed=1)


@pytest.fixture
def head(tmp_path, state, spec, vocab, tiny_target):
    from peagle.export.head import export_head

    return export_head(state, spec, vocab, tmp_path / "head", target_path=tiny_target)
