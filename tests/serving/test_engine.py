"""Engines open and close cleanly, one after another in one process; spec-decode metrics."""

import pytest

from peagle.config import VllmConfig
from peagle.serving import EngineStartError, open_llm
from peagle.serving.generation import generate_from_token_ids
from peagle.serving.metrics import delta, read_spec_decode_stats

CFG = VllmConfig(max_model_len=256, max_num_seqs=8, cpu_kvcache_space_gib=1)
# A prompt that repeats itself, so n-gram lookup finds drafts to propose.
PROMPTS = [[1, 3] + [50, 60, 70, 80, 90] * 6, [1, 3] + list(range(100, 140))]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from peagle.serving.tiny import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny_llama")))


def engine_processes(llm):
    return list(llm.llm_engine.engine_core.resources.engine_manager.processes)


def test_bad_model_dir_raises_engine_start_error(tmp_path):
    with pytest.raises(EngineStartError, match="could not start an engine"):
        with open_llm(str(tmp_path / "no-such-model"), CFG):
            pass


@pytest.mark.slow
def test_open_close_reopen_with_speculation_metrics(tiny_model):
    with open_llm(tiny_model, CFG, dtype="float32") as llm:
        procs = engine_processes(llm)
        assert procs and all(p.is_alive() for p in procs)
        plain = generate_from_token_ids(llm, PROMPTS, max_tokens=[32, 32])
        assert read_spec_decode_stats(llm).num_drafts == 0  # no speculation configured
    assert not any(p.is_alive() for p in procs), "closing must stop the engine process"

    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    with open_llm(tiny_model, CFG, dtype="float32", speculative_config=ngram) as llm:
        print(f"engine start-up: {llm.peagle_startup_s:.1f} s")
        before = read_spec_decode_stats(llm)
        spec = generate_from_token_ids(llm, PROMPTS, max_tokens=[32, 32])
        d = delta(before, read_spec_decode_stats(llm))
    # Greedy speculative decoding is lossless: same tokens as the plain engine.
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert d.num_drafts > 0 and 0 < d.num_draft_tokens <= 3 * d.num_drafts
    assert len(d.accepted_per_position) == 3
    assert sum(d.accepted_per_position) == d.num_accepted_tokens > 0
    assert d.accepted_per_position == sorted(d.accepted_per_position, reverse=True)
    assert d.acceptance_length == pytest.approx(1 + d.num_accepted_tokens / d.num_drafts)
    print("ngram spec decode:", d.as_dict())
