"""Magpie sources: the requests a target writes itself (the engine part: tests/target/test_gguf.py)."""

import pytest


def test_a_magpie_source_says_how_many_requests_and_its_template_must_render_them(tmp_path):
    from pydantic import ValidationError

    from peagle.config import PromptSource
    from peagle.data.synthesize import clean_request, user_turn_opening
    from peagle.testing.tiny import build_tiny_tokenizer

    with pytest.raises(ValidationError, match="kind: magpie source needs max_samples"):
        PromptSource(kind="magpie", path="self.jsonl")
    assert PromptSource(kind="magpie", path="self.jsonl", max_samples=10).max_samples == 10
    head, closing = user_turn_opening(build_tiny_tokenizer(tmp_path))
    assert head.endswith("<|user|>") or "<|user|>" in head
    assert clean_request("  Explain recursion briefly.<|end|>junk", "<|end|>") == "Explain recursion briefly."
    assert clean_request("hi", "") is None
