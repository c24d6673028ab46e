"""What a config's dataset will cost, stored or streamed, worked out before any work."""

import pytest

from peagle.config import ConfigError, parse_config
from peagle.data.budget import DataBudget, expected_samples
from peagle.data.store import bytes_per_token

TIB = 2**40


def budget(**kw) -> DataBudget:
    """An 8B shape (4 stored layers x 4096) with the GPU recipe's data: 200,000 samples of <= 8,192 tokens."""
    fields = dict(samples=200_000, heldout=512, max_tokens=8192, num_layers=4, hidden_size=4096,
                  storage_dtype="bfloat16", hidden_states="stored", spool_bytes=0, free=2 * TIB, where="/data")
    return DataBudget(**{**fields, **kw})


def test_an_8b_recipe_stored_in_bf16_is_tens_of_tib_and_refused_on_a_2_tib_disk_naming_streaming():
    b = budget()
    tokens = 200_000 * 8192
    assert b.tokens(b.samples) == tokens
    assert b.stored_bytes("bfloat16") == int(tokens * (4 * 4096 * 2 + 5) * 1.01)  # 32 KiB a token
    assert b.stored_bytes("float8") == int(tokens * (4 * 4096 + 5 + 16) * 1.01)
    assert 49 * TIB < b.stored_bytes("bfloat16") < 51 * TIB
    with pytest.raises(ConfigError) as refused:
        b.check_fits()
    message = str(refused.value)
    assert "set data.hidden_states: streamed" in message and "2.0 TiB free" in message, message
    assert "200,000 samples of up to 8,192 tokens" in message


def test_streamed_the_same_recipe_needs_its_tokens_its_heldout_states_and_the_spool():
    b = budget(hidden_states="streamed", spool_bytes=64 * 2**30)
    train_tokens = (200_000 - 512) * 8192
    heldout = int(512 * 8192 * bytes_per_token(4, 4096, "bfloat16") * 1.01)
    assert b.streamed_bytes() == int(train_tokens * 5 * 1.01) + heldout
    assert b.needed() == b.streamed_bytes() + 64 * 2**30
    assert b.needed() < 0.25 * TIB
    b.check_fits()  # fits the 2 TiB disk
    lines = "\n".join(b.lines())
    assert "samples: at most 200,000 (199,488 to train on), each at most 8,192 tokens" in lines
    assert "a spool of at most 64.0 GiB while training" in lines
    assert "every epoch extracts the train split again (1,634,205,696 tokens of prefill" in lines
    assert "this config (streamed) needs at most" in lines


def test_streamed_a_train_split_that_fits_the_spool_is_said_to_be_extracted_once():
    b = budget(samples=1_000, heldout=100, max_tokens=1_000, hidden_states="streamed", spool_bytes=64 * 2**30)
    assert b.train_hidden_bytes() == int(900 * 1_000 * bytes_per_token(4, 4096, "bfloat16") * 1.01)  # ~28 GiB
    assert "fit the spool: extracted once and kept for every epoch" in "\n".join(b.lines())
    assert "every epoch extracts" in budget(samples=1_000, heldout=100, max_tokens=1_000, hidden_states="streamed",
                                            spool_bytes=16 * 2**30).streamed_extraction()


def test_a_data_stage_spread_over_hosts_says_each_parts_share():
    assert not any(line.startswith("hosts:") for line in budget().lines())  # one host: nothing to say
    lines = "\n".join(budget(parts=3).lines())
    assert "hosts: the data stage in 3 parts (orchestration.data_parts), at most 66,667 samples each" in lines
    assert "an equal share of the samples each" in "\n".join(budget(parts=3, samples=None).lines())


def test_even_streamed_a_config_can_be_too_big_and_says_what_to_lower():
    with pytest.raises(ConfigError, match="lower data.spool_gib, data.max_samples or data.max_seq_len"):
        budget(hidden_states="streamed", spool_bytes=64 * 2**30, free=10 * 2**30).check_fits()


def test_a_resumed_build_counts_what_it_already_stored():
    b = budget(free=10 * TIB)
    assert b.shortfall() is not None
    assert b.shortfall(already_stored=45 * TIB) is None


def test_hub_sets_not_read_here_count_by_max_samples_else_the_mix_cap():
    cfg = parse_config({"name": "b", "target": {"model": "embedded"},
                        "data": {"sources": [{"kind": "hf", "path": "x/y"}], "max_samples": 1000}})
    [source] = cfg.data.sources
    assert expected_samples(cfg, 0, [], [source]) == 1000
    uncapped = cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_samples": None})})
    assert expected_samples(uncapped, 0, [], [source]) is None
    assert "unknown (a hub set not counted here: give it max_samples)" in budget(samples=None).lines()[2]
    assert budget(samples=None).shortfall() is None  # nothing to refuse on


def test_spool_gib_is_not_the_datasets_identity_but_hidden_states_is():
    base = {"name": "b", "target": {"model": "embedded"}, "data": {"sources": [{"kind": "jsonl", "path": "p.jsonl"}]}}
    stored = parse_config(base)
    explicit = parse_config({**base, "data": {**base["data"], "hidden_states": "stored", "spool_gib": 9}})
    streamed = parse_config({**base, "data": {**base["data"], "hidden_states": "streamed"}})
    assert stored.section_hash("target", "data") == explicit.section_hash("target", "data")
    assert streamed.section_hash("target", "data") != stored.section_hash("target", "data")
