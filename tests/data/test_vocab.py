"""The draft vocabulary: top-Vd supervised tokens, vLLM's offset convention, exact maps."""

import pytest
import torch

from peagle.data.store import ShardReader, ShardWriter
from peagle.data.vocab import DraftVocab, build_draft_vocab, count_tokens


def test_top_tokens_with_deterministic_ties():
    counts = torch.tensor([5, 0, 9, 5, 1, 9, 0, 5])
    vocab = build_draft_vocab(counts, 4)
    # 9, 9 (ids 2, 5), then the tie at 5 goes to the lowest ids (0, 3).
    assert vocab.draft_ids.tolist() == [0, 2, 3, 5]
    assert (vocab.draft_ids == torch.arange(4) + vocab.d2t).all()  # vLLM: target = i + d2t[i]
    assert vocab.t2d.tolist() == [True, False, True, True, False, True, False, False]
    assert vocab.d2t.dtype == torch.int64 and vocab.t2d.dtype == torch.bool


def test_maps_round_trip():
    g = torch.Generator().manual_seed(0)
    vocab = build_draft_vocab(torch.randint(0, 100, (1000,), generator=g), 300)
    draft = torch.arange(300)
    assert torch.equal(vocab.to_draft(vocab.to_target(draft)), draft)
    outside = torch.nonzero(~vocab.t2d).flatten()[:5]
    assert (vocab.to_draft(outside) == -1).all()


def test_full_vocabulary_is_the_identity():
    vocab = build_draft_vocab(torch.randint(0, 5, (50,)), 50)
    assert torch.equal(vocab.draft_ids, torch.arange(50)) and not vocab.d2t.any() and vocab.t2d.all()


def test_draft_vocab_larger_than_target_is_refused():
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_draft_vocab(torch.ones(10), 11)


def test_save_load(tmp_path):
    vocab = build_draft_vocab(torch.arange(64), 16)
    vocab.save(tmp_path / "vocab.safetensors")
    loaded = DraftVocab.load(tmp_path / "vocab.safetensors")
    for name in ("draft_ids", "d2t", "t2d"):
        assert torch.equal(getattr(loaded, name), getattr(vocab, name))


def test_counts_only_supervised_tokens(tmp_path):
    with ShardWriter(tmp_path, [1, 2, 3, 4], 8, "bfloat16", 256) as w:
        w.add("a", [7, 7, 3, 3, 3], [False, False, True, True, True], torch.zeros(5, 4, 8))
        w.add("b", [9, 7, 1], [True, True, False], torch.zeros(3, 4, 8))
    counts = count_tokens(ShardReader(tmp_path), 10)
    assert counts.tolist() == [0, 0, 0, 3, 0, 0, 0, 1, 0, 1]
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        count_tokens(ShardReader(tmp_path), 8)
