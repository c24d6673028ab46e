"""The deployment path end to end: export -> register -> promote -> download champion -> vLLM.

A head exported for the embedded target is registered in a fresh SQLite MLflow store,
promoted to ``champion``, downloaded by alias into a new directory, and THAT directory
is served by vLLM with parallel drafting. Random weights are enough: the test is about
the bytes surviving the registry round trip and loading as a speculative head, so it
checks that drafts were proposed (K tokens each), not how many were accepted.
"""

import json

import pytest

from peagle.config import TrackingConfig, VllmConfig

pytestmark = pytest.mark.slow
K = 3
DRAFT_VOCAB = 256


@pytest.fixture(scope="module")
def exported_head(embedded_target, tmp_path_factory):
    """A random-weights head in vLLM's layout, validated against the embedded target."""
    from peagle.export import export_head
    from peagle.export.selftest import draft_vocab_skipping_low_ids, random_head_state_dict, tiny_head_spec

    spec = tiny_head_spec(embedded_target, draft_vocab_size=DRAFT_VOCAB)
    vocab = draft_vocab_skipping_low_ids(spec.vocab_size, DRAFT_VOCAB, spec.mask_token_id)
    out = tmp_path_factory.mktemp("export") / "peagle-head"
    return export_head(random_head_state_dict(spec, seed=3), spec, vocab, out, target_path=embedded_target)


@pytest.fixture(scope="module")
def champion_dir(exported_head, embedded_target, tmp_path_factory):
    """Register the head in a tmp SQLite store, promote it, and download the champion."""
    from peagle.tracking import Tracker
    from peagle.tracking.registry import (
        CHAMPION,
        download_champion,
        promote_if_better,
        register_head,
    )

    store = tmp_path_factory.mktemp("mlflow")
    tracking = TrackingConfig(tracking_uri=f"sqlite:///{store / 'mlflow.db'}")
    with Tracker(tracking, str(embedded_target), run_name="champion-serving") as tracker:
        name = tracker.registered_model_name
        version = register_head(tracker, tracker.run_id, exported_head, name,
                                tags={"method": "p-eagle", "K": str(K)}, metrics={"score": 1.0})
        decision = promote_if_better(tracker, name, version.version, 1.0, margin=0.0, validated=True)
        assert decision.promoted, decision.reason
        assert tracker.client.get_registered_model(name).aliases[CHAMPION] == version.version
        served = download_champion(tracker, name, tmp_path_factory.mktemp("deploy") / "champion")
    return served


def test_champion_download_is_the_exported_head(exported_head, champion_dir):
    assert champion_dir != exported_head
    for name in ("config.json", "model.safetensors"):
        assert (champion_dir / name).read_bytes() == (exported_head / name).read_bytes()
    assert json.loads((champion_dir / "config.json").read_text())["architectures"]


def test_champion_download_is_served_by_vllm_with_parallel_drafting(champion_dir, embedded_target):
    from transformers import AutoTokenizer

    from peagle.eval.online import tokenize_prompts
    from peagle.export.contract import speculative_config
    from peagle.serving.engine import open_llm
    from peagle.serving.generation import generate_from_token_ids
    from peagle.serving.metrics import delta, read_spec_decode_stats

    tokenizer = AutoTokenizer.from_pretrained(str(embedded_target))
    prompts = tokenize_prompts(["Write a Python function that reverses a list.",
                                "def fibonacci(n):"], tokenizer)
    cfg = VllmConfig(max_model_len=256, max_num_seqs=4, cpu_kvcache_space_gib=1)
    with open_llm(str(embedded_target), cfg,
                  speculative_config=speculative_config(str(champion_dir), K, parallel_drafting=True)) as llm:
        assert llm.llm_engine.vllm_config.speculative_config.parallel_drafting
        before = read_spec_decode_stats(llm)
        outputs = generate_from_token_ids(llm, prompts, max_tokens=[24, 24])
        stats = delta(before, read_spec_decode_stats(llm))

    assert all(len(o.token_ids) > 0 for o in outputs)
    assert stats.num_drafts > 0, "vLLM served the champion but proposed no draft tokens"
    assert stats.num_draft_tokens == K * stats.num_drafts  # parallel drafting: K tokens per draft
    assert 1.0 <= stats.acceptance_length <= K + 1
    assert len(stats.accepted_per_position) == K
