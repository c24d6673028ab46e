"""Spec-decode counters from vLLM's metric snapshot types (no engine needed)."""

import math

import pytest
from vllm.v1.metrics.reader import Counter, Gauge, Vector

from peagle.serving.metrics import SpecDecodeStats, delta, stats_from_metrics


def snapshot(drafts, draft_tokens, accepted, per_pos, engine="0"):
    labels = {"engine": engine, "model_name": "m"}
    return [
        Counter("vllm:spec_decode_num_drafts", labels, drafts),
        Counter("vllm:spec_decode_num_draft_tokens", labels, draft_tokens),
        Counter("vllm:spec_decode_num_accepted_tokens", labels, accepted),
        Vector("vllm:spec_decode_num_accepted_tokens_per_pos", labels, per_pos),
        Counter("vllm:prompt_tokens", labels, 999),  # unrelated counters are ignored
        Gauge("vllm:num_requests_running", labels, 1.0),
    ]


def test_reads_counters_and_sums_engines():
    stats = stats_from_metrics(snapshot(10, 30, 12, [7, 4, 1]) + snapshot(5, 15, 3, [2, 1, 0], engine="1"))
    assert stats == SpecDecodeStats(15, 45, 15, [9, 5, 1])


def test_acceptance_length_and_rates():
    stats = SpecDecodeStats(num_drafts=10, num_draft_tokens=30, num_accepted_tokens=12, accepted_per_position=[7, 4, 1])
    assert stats.acceptance_length == pytest.approx(2.2)
    assert stats.acceptance_rate == pytest.approx(0.4)
    assert stats.per_position_acceptance == pytest.approx([0.7, 0.4, 0.1])
    assert stats.as_dict()["acceptance_length"] == pytest.approx(2.2)


def test_no_drafts_gives_nan_not_a_crash():
    stats = stats_from_metrics([])
    assert stats.num_drafts == 0 and stats.accepted_per_position == []
    assert math.isnan(stats.acceptance_length) and math.isnan(stats.acceptance_rate)


def test_delta_between_snapshots():
    before = SpecDecodeStats(10, 30, 12, [7, 4, 1])
    after = SpecDecodeStats(25, 75, 40, [20, 14, 6])
    d = delta(before, after)
    assert d == SpecDecodeStats(15, 45, 28, [13, 10, 5])
    assert d.acceptance_length == pytest.approx(1 + 28 / 15)
    assert delta(SpecDecodeStats(), after) == after  # from an engine's first snapshot
