"""COD sampling: nested per-depth anchor sets of the right size, only where supervised."""

from __future__ import annotations

import math

import pytest
import torch

from peagle.objective.cod import depth_budget, sample_cod


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


@pytest.mark.parametrize("depth,ratio,seed", [(1, 0.6, 3), (2, 0.7, 4)])
def test_draws_are_uniform_over_anchors(depth, ratio, seed):
    """Over many draws every eligible anchor is kept about equally often, at depth 1 and at the
    nested depth 2 (drawn from depth 1's set), and each draw keeps exactly its budget."""
    n, draws = 50, 600
    valid = torch.ones(n, dtype=torch.bool)
    g = torch.Generator().manual_seed(seed)
    hits = torch.zeros(n)
    for _ in range(draws):
        hits[sample_cod(valid, depth + 1, ratio, 0.0, g)[depth]] += 1
    eligible = n - depth  # (p, d) needs position p + d < n
    assert hits[eligible:].sum() == 0
    freq = hits[:eligible] / draws
    assert (freq - freq.mean()).abs().max() < 0.1, freq
    assert abs(freq.mean() - depth_budget(n, depth, ratio, 0.0) / eligible) < 1e-6


def test_tiny_and_bad_inputs():
    assert [s.numel() for s in sample_cod(torch.ones(1, dtype=torch.bool), 3, 0.8, 0.2)] == [1, 0, 0]
    assert [s.numel() for s in sample_cod(torch.zeros(0, dtype=torch.bool), 3, 0.8, 0.2)] == [0, 0, 0]
    with pytest.raises(ValueError, match="bool"):
        sample_cod(torch.ones(4), 3, 0.8, 0.2)
    with pytest.raises(ValueError, match="ratio"):
        sample_cod(torch.ones(4, dtype=torch.bool), 3, 0.0, 0.2)
    with pytest.raises(ValueError, match="k"):
        sample_cod(torch.ones(4, dtype=torch.bool), 0, 0.8, 0.2)
