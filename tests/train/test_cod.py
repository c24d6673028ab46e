"""COD sampling: nested per-depth anchor sets of the right size, only where supervised."""

from __future__ import annotations

import math

import pytest
import torch

from peagle.train.cod import depth_budget, sample_cod


def test_depth_zero_keeps_every_anchor_and_sets_nest():
    valid = torch.ones(500, dtype=torch.bool)
    sets = sample_cod(valid, 8, 0.8, 0.2, torch.Generator().manual_seed(0))
    assert len(sets) == 8
    assert torch.equal(sets[0], torch.arange(500))
    for shallow, deep in zip(sets, sets[1:]):
        assert torch.equal(deep, deep.sort().values) and deep.unique().numel() == deep.numel()
        assert torch.isin(deep, shallow).all()


@pytest.mark.parametrize("ratio,floor", [(0.8, 0.2), (0.7, 0.2), (0.5, 0.0), (1.0, 1.0)])
def test_sizes_follow_ratio_power_with_floor(ratio, floor):
    n, k = 1000, 8
    valid = torch.ones(n, dtype=torch.bool)
    sets = sample_cod(valid, k, ratio, floor, torch.Generator().manual_seed(1))
    for d in range(1, k):
        eligible_cap = int((sets[d - 1] + d < n).sum()) if d > 1 else n - 1  # (p, d) needs p at d-1 and position p + d < n
        want = min(math.floor(n * max(ratio**d, floor) + 0.5), eligible_cap)  # round half up
        assert sets[d].numel() == want, (d, sets[d].numel(), want)
    assert depth_budget(1000, 3, 0.8, 0.2) == 512 and depth_budget(1000, 9, 0.8, 0.2) == 200


def test_only_supervised_elements_are_sampled_at_depth():
    n = 300
    valid = torch.zeros(n, dtype=torch.bool)
    valid[100:250] = True  # the assistant span, seen from anchors
    sets = sample_cod(valid, 6, 0.9, 0.3, torch.Generator().manual_seed(2))
    assert sets[0].numel() == n  # context keeps everything
    for d in range(1, 6):
        assert valid[sets[d]].all() and valid[sets[d] + d].all(), d  # (p, d) predicts what anchor p + d does
        assert sets[d].numel() <= round(150 * max(0.9**d, 0.3))


def test_same_generator_seed_same_sets_and_different_seeds_differ():
    valid = torch.ones(200, dtype=torch.bool)
    a = sample_cod(valid, 5, 0.7, 0.2, torch.Generator().manual_seed(7))
    b = sample_cod(valid, 5, 0.7, 0.2, torch.Generator().manual_seed(7))
    c = sample_cod(valid, 5, 0.7, 0.2, torch.Generator().manual_seed(8))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def test_draws_are_uniform_over_anchors():
    """Over many draws every eligible anchor is kept at depth 1 about ratio of the time."""
    valid = torch.ones(50, dtype=torch.bool)
    g = torch.Generator().manual_seed(3)
    hits = torch.zeros(50)
    for _ in range(400):
        hits[sample_cod(valid, 2, 0.6, 0.0, g)[1]] += 1
    freq = hits[:49] / 400  # anchor 49 has no depth-1 element (no position 50)
    assert hits[49] == 0
    assert (freq - 30 / 49).abs().max() < 0.12


def test_nested_depths_are_uniform_too():
    """Depth 2 is drawn from depth 1's set: still every eligible anchor about equally often."""
    valid = torch.ones(50, dtype=torch.bool)
    g = torch.Generator().manual_seed(4)
    hits = torch.zeros(50)
    for _ in range(600):
        hits[sample_cod(valid, 3, 0.7, 0.0, g)[2]] += 1
    assert hits[48:].sum() == 0  # (p, 2) needs position p + 2 < 50
    freq = hits[:48] / 600
    assert (freq - freq.mean()).abs().max() < 0.1, freq
    assert abs(freq.mean() - depth_budget(50, 2, 0.7, 0.0) / 48) < 1e-6  # every draw keeps its budget of the 48 eligible


def test_tiny_and_bad_inputs():
    assert [s.numel() for s in sample_cod(torch.ones(1, dtype=torch.bool), 3, 0.8, 0.2)] == [1, 0, 0]
    assert [s.numel() for s in sample_cod(torch.zeros(0, dtype=torch.bool), 3, 0.8, 0.2)] == [0, 0, 0]
    with pytest.raises(ValueError, match="bool"):
        sample_cod(torch.ones(4), 3, 0.8, 0.2)
    with pytest.raises(ValueError, match="ratio"):
        sample_cod(torch.ones(4, dtype=torch.bool), 3, 0.0, 0.2)
    with pytest.raises(ValueError, match="k"):
        sample_cod(torch.ones(4, dtype=torch.bool), 0, 0.8, 0.2)
