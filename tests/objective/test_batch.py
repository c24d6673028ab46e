"""Training elements: inputs, positions and targets exactly as the method note defines them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from peagle.facts import HeadSpec
from peagle.objective.batch import build_peagle_example, collate
from peagle.objective.masks import PrecomputedMask

HT = 8
SPEC = HeadSpec(
    target="tiny", target_revision=None, target_num_layers=6, target_hidden_size=HT, vocab_size=50,
    aux_layer_ids=[2, 3, 4], final_layer_id=6, mask_token_id=49, hidden_size=HT, num_layers=1,
    num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16, rms_norm_eps=1e-5,
    rope_theta=10000.0, rope_scaling=None, max_position_embeddings=256, draft_vocab_size=20,
)


def sample(n: int, seed: int = 0, loss_from: int = 0):
    g = torch.Generator().manual_seed(seed)
    return SimpleNamespace(
        token_ids=torch.randint(0, 48, (n,), generator=g),
        loss_mask=torch.arange(n) >= loss_from,
        hidden=torch.randn(n, 4, HT, generator=g).to(torch.bfloat16),
    )


def element(example, anchor, depth):
    hit = ((example.anchor == anchor) & (example.depth == depth)).nonzero()
    return int(hit) if len(hit) else None


def test_elements_follow_the_method_note():
    s = sample(30, loss_from=12)
    k = 4
    ex = build_peagle_example(s, SPEC, k, 1.0, 1.0, 64)  # ratio 1: every eligible element
    hidden = s.hidden.float()
    assert torch.equal(ex.anchor[ex.depth == 0], torch.arange(29))  # every anchor is context
    for p in range(29):
        i = element(ex, p, 0)
        assert ex.input_ids[i] == s.token_ids[p + 1] and ex.position_ids[i] == p and not ex.is_mask[i]
        # aux layers concatenated in layer order: [g_p^(a0), g_p^(a1), g_p^(a2)]
        assert torch.equal(ex.aux_hidden[i], hidden[p, :3].reshape(-1))
        assert ex.supervised[i] == (p + 1 >= 12)
        for d in range(1, k):
            j = element(ex, p, d)
            served = p + 1 >= 12 and p + 1 + d < 30  # x_{p+1} is a response token, target exists
            assert (j is not None) == served, (p, d)  # only served, supervisable chains are sampled
            if j is None:
                continue
            assert ex.input_ids[j] == SPEC.mask_token_id and ex.is_mask[j]
            assert ex.position_ids[j] == p + d and not ex.aux_hidden[j].any()
            assert ex.supervised[j] and torch.equal(ex.target_hidden[j], hidden[p + 1 + d, 3])
    sup0 = (ex.depth == 0) & ex.supervised
    assert torch.equal(ex.target_hidden[sup0], hidden[ex.anchor[sup0] + 1, 3])
    assert not ex.target_hidden[~ex.supervised].any()
    assert ex.aux_hidden.dtype == torch.float32


def test_layout_is_depth_major_with_sorted_anchors():
    ex = build_peagle_example(sample(50), SPEC, 5, 0.7, 0.2, 64, torch.Generator().manual_seed(0))
    key = ex.depth * 1000 + ex.anchor
    assert (key[1:] > key[:-1]).all()
    assert ex.depth.bincount().tolist() == [49, 34, 24, 17, 12]


def test_truncation_to_max_len():
    ex = build_peagle_example(sample(100), SPEC, 3, 1.0, 1.0, 40)
    assert int(ex.anchor.max()) == 38 and int(ex.position_ids.max()) <= 38 + 2


def test_packed_documents_get_doc_ids_restarting_positions_and_disjoint_anchors():
    a, b = sample(20, seed=1), sample(15, seed=2)
    ex = build_peagle_example([a, b], SPEC, 3, 1.0, 1.0, 64)
    in_b = ex.doc == 1
    assert torch.equal(ex.anchor[~in_b & (ex.depth == 0)], torch.arange(19))
    assert torch.equal(ex.anchor[in_b & (ex.depth == 0)], torch.arange(19, 33))
    assert torch.equal(ex.position_ids[in_b & (ex.depth == 0)], torch.arange(14))
    alone = build_peagle_example(b, SPEC, 3, 1.0, 1.0, 64)
    assert torch.equal(ex.input_ids[in_b], alone.input_ids) and torch.equal(ex.position_ids[in_b], alone.position_ids)
    with pytest.raises(ValueError, match="max_len"):
        build_peagle_example([a, b], SPEC, 3, 1.0, 1.0, 30)


def test_collate_pads_and_counts():
    e1 = build_peagle_example(sample(10, seed=3), SPEC, 3, 1.0, 1.0, 64)
    e2 = build_peagle_example(sample(25, seed=4, loss_from=5), SPEC, 3, 1.0, 1.0, 64)
    batch = collate([e1, e2], PrecomputedMask(64, 3))
    n = len(e2)
    assert batch.input_ids.shape == (2, n) and batch.aux_hidden.shape == (2, n, 3 * HT)
    assert batch.target_hidden.shape == (2, n, HT) and batch.attention_mask.shape == (2, n, n)
    assert batch.valid[0].sum() == len(e1) and not batch.supervised[0, len(e1) :].any()
    assert (batch.doc[0, len(e1) :] == -1).all()
    assert batch.num_supervised == e1.num_supervised + e2.num_supervised
    moved = batch.to("cpu", dtype=torch.float64)
    assert moved.aux_hidden.dtype == torch.float64 and moved.input_ids.dtype == torch.long


def test_bad_samples_are_named():
    bad = sample(10)
    bad.hidden = bad.hidden[:, :3]
    with pytest.raises(ValueError, match="sample.hidden"):
        build_peagle_example(bad, SPEC, 3, 0.8, 0.2, 64)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        build_peagle_example(sample(1), SPEC, 3, 0.8, 0.2, 64)


def test_true_previous_slots_read_the_real_token_before_their_target():
    """The upper-bound measurement: each mask slot (p, d) reads x_{p+1+d}, the token before the one it
    predicts, and still takes mask_hidden (is_mask) as its feature; depth 0 is unchanged."""
    s = sample(30, loss_from=12)
    plain = build_peagle_example(s, SPEC, 4, 1.0, 1.0, 64)
    ex = build_peagle_example(s, SPEC, 4, 1.0, 1.0, 64, mask_slot_inputs="true_previous")
    deep = ex.depth > 0
    assert deep.any() and torch.equal(ex.is_mask, plain.is_mask) and torch.equal(ex.depth, plain.depth)
    assert torch.equal(ex.input_ids[deep], s.token_ids[ex.anchor[deep] + 1 + ex.depth[deep]])
    assert torch.equal(ex.input_ids[~deep], plain.input_ids[~deep])
    assert (plain.input_ids[deep] == SPEC.mask_token_id).all()
    with pytest.raises(ValueError, match="'mask' or 'true_previous'"):
        build_peagle_example(s, SPEC, 4, 1.0, 1.0, 64, mask_slot_inputs="oracle")
