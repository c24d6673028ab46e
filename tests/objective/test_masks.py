"""P-EAGLE masks (precomputed, and evaluated from a batch's elements) equal the attention rule pair by pair."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from peagle.facts import HeadSpec
from peagle.objective.batch import build_peagle_example, collate
from peagle.objective.cod import sample_cod
from peagle.objective.masks import PrecomputedMask, block_types, brute_force_mask, element_mask


def cod_elements(n: int, k: int, seed: int, valid_from: int = 0):
    valid = torch.arange(n) >= valid_from
    sets = sample_cod(valid, k, 0.75, 0.2, torch.Generator().manual_seed(seed))
    anchor = torch.cat(sets)
    depth = torch.cat([torch.full((len(s),), d) for d, s in enumerate(sets)])
    return anchor, depth


def pair_by_pair(anchor, depth, doc):
    """The method note's rule, literally, one pair at a time."""
    n = len(anchor)
    out = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        for k in range(n):
            same_doc = doc[q] == doc[k]
            context = depth[k] == 0 and anchor[k] <= anchor[q]
            chain = anchor[k] == anchor[q] and depth[k] <= depth[q]
            out[q, k] = bool(same_doc and (context or chain))
    return out


def test_brute_force_is_the_rule():
    anchor, depth = cod_elements(12, 4, seed=0)
    doc = (anchor >= 7).long()
    assert torch.equal(brute_force_mask(anchor, depth, doc), pair_by_pair(anchor, depth, doc))


def test_block_structure():
    types = block_types(3)
    assert types.tolist() == [[1, 0, 0], [1, 2, 0], [1, 2, 2]]


@pytest.mark.parametrize("seed", range(5))
def test_precomputed_equals_brute_force_on_cod_samples(seed):
    mask = PrecomputedMask(max_len=300, k=6)
    n = 50 + 50 * seed
    anchor, depth = cod_elements(n, 6, seed=seed, valid_from=seed * 7)
    assert torch.equal(mask.mask_for(anchor, depth), brute_force_mask(anchor, depth))


def test_multiple_documents_never_attend_across():
    mask = PrecomputedMask(max_len=200, k=5)
    parts = []
    offset = 0
    for doc_id, n in enumerate([40, 70, 25]):
        anchor, depth = cod_elements(n, 5, seed=doc_id)
        parts.append((anchor + offset, depth, torch.full_like(anchor, doc_id)))
        offset += n
    anchor, depth, doc = (torch.cat(x) for x in zip(*parts))
    order = torch.argsort(depth, stable=True)  # depth-major, as the example builder lays them out
    anchor, depth, doc = anchor[order], depth[order], doc[order]
    got = mask.mask_for(anchor, depth, doc)
    assert torch.equal(got, brute_force_mask(anchor, depth, doc))
    assert not (got & (doc[:, None] != doc[None, :])).any()


def test_any_element_order_gives_the_permuted_mask():
    mask = PrecomputedMask(max_len=100, k=4)
    anchor, depth = cod_elements(60, 4, seed=3)
    perm = torch.randperm(len(anchor), generator=torch.Generator().manual_seed(0))
    doc = (anchor[perm] > 30).long()
    assert torch.equal(mask.mask_for(anchor[perm], depth[perm], doc), brute_force_mask(anchor[perm], depth[perm], doc))


def test_padding_in_a_collated_batch_matches_brute_force_with_valid():
    ht = 8
    spec = HeadSpec(
        target="tiny", target_revision=None, target_num_layers=6, target_hidden_size=ht, vocab_size=50,
        aux_layer_ids=[2, 3, 4], final_layer_id=6, mask_token_id=49, hidden_size=ht, num_layers=1,
        num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16, rms_norm_eps=1e-5,
        rope_theta=10000.0, rope_scaling=None, max_position_embeddings=256, draft_vocab_size=20,
    )
    g = torch.Generator().manual_seed(0)

    def sample(n):
        return SimpleNamespace(
            token_ids=torch.randint(0, 48, (n,), generator=g),
            loss_mask=torch.rand(n, generator=g) > 0.3,
            hidden=torch.randn(n, 4, ht, generator=g),
        )

    examples = [
        build_peagle_example(sample(30), spec, 5, 0.8, 0.2, 64, g),
        build_peagle_example([sample(20), sample(25)], spec, 5, 0.8, 0.2, 64, g),
        build_peagle_example(sample(64), spec, 5, 0.8, 0.2, 64, g),
    ]
    batch = collate(examples, PrecomputedMask(64, 5))
    assert batch.attention_mask.shape == (3, max(len(e) for e in examples), max(len(e) for e in examples))
    for b in range(3):
        want = brute_force_mask(batch.anchor[b], batch.depth[b], batch.doc[b], batch.valid[b])
        assert torch.equal(batch.attention_mask[b], want)
    assert not batch.attention_mask[0, len(examples[0]) :].any()


def test_out_of_range_is_a_clear_error():
    mask = PrecomputedMask(max_len=10, k=3)
    with pytest.raises(ValueError, match="max_len"):
        mask.mask_for(torch.tensor([0, 10]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="k=3"):
        mask.mask_for(torch.tensor([0, 1]), torch.tensor([0, 3]))


def test_out_buffer_is_fully_overwritten_and_duplicates_rejected():
    mask = PrecomputedMask(max_len=80, k=4)
    anchor, depth = cod_elements(80, 4, seed=9)
    buffer = torch.ones(len(anchor), len(anchor), dtype=torch.bool)
    mask.mask_for(anchor, depth, out=buffer)
    assert torch.equal(buffer, brute_force_mask(anchor, depth))
    with pytest.raises(ValueError, match="twice"):
        mask.mask_for(torch.tensor([3, 1, 3]), torch.tensor([1, 0, 1]))


@pytest.mark.parametrize("seed", range(4))
def test_element_mask_equals_brute_force_in_any_order_with_documents_padding_and_duplicates(seed):
    """The batch's evaluated mask is the rule: shuffled elements, several docs, padding, repeats."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(25):
        n = int(torch.randint(1, 70, (1,), generator=g))
        anchor = torch.randint(0, 15, (n,), generator=g)
        depth = torch.randint(0, 5, (n,), generator=g)
        doc = torch.randint(0, 3, (n,), generator=g)
        valid = torch.rand(n, generator=g) > 0.2
        for d, v in ((None, None), (doc, None), (None, valid), (doc, valid)):
            assert torch.equal(element_mask(anchor, depth, d, v), brute_force_mask(anchor, depth, d, v))
    anchor, depth = cod_elements(90, 6, seed=seed)
    perm = torch.randperm(len(anchor), generator=g)
    doc = (anchor >= 40).long()
    stacked = element_mask(torch.stack([anchor, anchor[perm]]), torch.stack([depth, depth[perm]]),
                           torch.stack([doc, doc[perm]]))
    assert torch.equal(stacked[0], pair_by_pair(anchor, depth, doc))
    assert torch.equal(stacked[1], brute_force_mask(anchor[perm], depth[perm], doc[perm]))
