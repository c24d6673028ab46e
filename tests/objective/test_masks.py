"""P-EAGLE masks (precomputed, and evaluated from a batch's elements) equal the attention rule pair by pair."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from peagle.facts import HeadSpec
from peagle.objective.batch import build_peagle_example, collate
from peagle.objective.cod import sample_cod
from peagle.objective.masks import ElementAttention, PrecomputedMask, block_types, brute_force_mask, element_mask


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


# ----------------------------------------------------------------------------- flex attention's form of the rule


def collated_elements(seed: int, k: int = 6):
    """A padded batch of three rows: one document, two packed documents, a shorter one (COD each)."""
    ht = 8
    spec = HeadSpec(
        target="tiny", target_revision=None, target_num_layers=6, target_hidden_size=ht, vocab_size=50,
        aux_layer_ids=[2, 3, 4], final_layer_id=6, mask_token_id=49, hidden_size=ht, num_layers=1,
        num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16, rms_norm_eps=1e-5,
        rope_theta=10000.0, rope_scaling=None, max_position_embeddings=256, draft_vocab_size=20,
    )
    g = torch.Generator().manual_seed(seed)

    def sample(n):
        return SimpleNamespace(token_ids=torch.randint(0, 48, (n,), generator=g),
                               loss_mask=torch.rand(n, generator=g) > 0.3, hidden=torch.randn(n, 4, ht, generator=g))

    examples = [
        build_peagle_example(sample(90), spec, k, 0.8, 0.2, 96, g),
        build_peagle_example([sample(40), sample(30), sample(20)], spec, k, 0.7, 0.2, 96, g),
        build_peagle_example(sample(33), spec, k, 0.8, 0.2, 96, g),
    ]
    return collate(examples, PrecomputedMask(96, k)).attention


def random_elements(seed: int):
    """Rows in no particular order, several documents, padding anywhere, repeated (anchor, depth)."""
    g = torch.Generator().manual_seed(seed)
    b, n = 2, int(torch.randint(40, 200, (1,), generator=g))
    return ElementAttention(torch.randint(0, 30, (b, n), generator=g), torch.randint(0, 5, (b, n), generator=g),
                            torch.randint(0, 3, (b, n), generator=g), torch.rand(b, n, generator=g) > 0.15)


def rule_with_diagonal(att: ElementAttention) -> torch.Tensor:
    """Bool [B, N, N]: the rule pair by pair, every element reading itself (the drafter's dense mask)."""
    eye = torch.eye(att.shape[1], dtype=torch.bool)
    return torch.stack([brute_force_mask(*(t[row] for t in (att.anchor, att.depth, att.doc, att.valid))) | eye
                        for row in range(att.shape[0])])


def by_tile(mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """[..., N, N] -> [..., tiles, block_size, tiles, block_size], zero-padded past N."""
    n = mask.shape[-1]
    tiles = -(-n // block_size)
    pad = tiles * block_size - n
    return torch.nn.functional.pad(mask, (0, pad, 0, pad)).unflatten(-1, (tiles, block_size)).unflatten(-3, (tiles, block_size))


def tile_sets(block_mask, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) Bool [B, tiles, tiles] from a BlockMask's per-query-tile index lists."""
    out = []
    for count, index in ((block_mask.kv_num_blocks, block_mask.kv_indices),
                         (block_mask.full_kv_num_blocks, block_mask.full_kv_indices)):
        listed = torch.zeros(count.shape[0], tiles, tiles, dtype=torch.bool)
        for b in range(count.shape[0]):
            for i in range(tiles):
                listed[b, i, index[b, 0, i, : count[b, 0, i]].long()] = True
        out.append(listed)
    return out[0], out[1]


@pytest.mark.parametrize("elements", [collated_elements, random_elements])
@pytest.mark.parametrize("seed", range(3))
def test_mask_mod_is_the_rule(elements, seed):
    att = elements(seed)
    b, n = att.shape
    got = att.mask_mod()(torch.arange(b)[:, None, None], 0, torch.arange(n)[None, :, None], torch.arange(n)[None, None, :])
    assert torch.equal(got, rule_with_diagonal(att))
    assert torch.equal(att.dense() | torch.eye(n, dtype=torch.bool), rule_with_diagonal(att))


@pytest.mark.parametrize("elements", [collated_elements, random_elements])
@pytest.mark.parametrize("block_size", [8, 32, 128])
@pytest.mark.parametrize("seed", range(3))
def test_block_mask_visits_every_allowed_tile_and_its_full_tiles_allow_every_pair(elements, block_size, seed):
    """Flex attention computes only the listed tiles, and skips ``mask_mod`` on the full ones: an
    allowed pair outside them would be lost, a forbidden pair inside a full one let through."""
    att = elements(seed)
    b, n = att.shape
    block_mask = att.block_mask(block_size)
    assert block_mask.seq_lengths == (n, n) and block_mask.BLOCK_SIZE == (block_size, block_size)
    partial, full = tile_sets(block_mask, -(-n // block_size))
    allowed = by_tile(rule_with_diagonal(att), block_size)
    inside = by_tile(torch.ones(n, n, dtype=torch.bool), block_size)
    assert not (partial & full).any()
    assert (allowed.any(4).any(2) <= (partial | full)).all()
    assert (full <= (allowed & inside).all(4).all(2)).all()
    if elements is collated_elements and block_size == 8:
        assert full.any() and (~(partial | full)).any()  # the layout has whole context tiles and skipped ones


def test_block_mask_of_a_long_example_visits_a_fraction_of_the_tiles():
    """K 8, COD 0.8, 2048 tokens: its tiles are visited where the rule allows a pair, not everywhere."""
    anchor, depth = cod_elements(2048, 8, seed=0)
    one_doc, real = torch.zeros_like(anchor), torch.ones_like(anchor, dtype=torch.bool)
    att = ElementAttention(anchor[None], depth[None], one_doc[None], real[None])
    partial, full = tile_sets(att.block_mask(), -(-len(anchor) // 128))
    needed = by_tile(rule_with_diagonal(att), 128).any(4).any(2)
    assert torch.equal(partial | full, needed)  # one document in builder order: the bounds are exact
    assert float(needed.float().mean()) < 0.3
