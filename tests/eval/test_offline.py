"""Offline acceptance equals a brute-force simulation of greedy speculative decoding as vLLM runs it:
drafts per anchor as vLLM's proposer makes them, counted per draft along the decoding walk."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "objective"))  # the tiny-model helpers
from test_partition import make_models, tiny_spec  # noqa: E402

from peagle.data.store import ShardReader, ShardWriter  # noqa: E402
from peagle.data.vocab import vocab_from_ids  # noqa: E402
from peagle.eval.offline import (  # noqa: E402
    _draft_batch,
    accepted_counts,
    draft_tokens,
    drafting_anchors,
    evaluate_offline,
    ngram_drafts,
    reference_tokens,
    walk_drafts,
)
from peagle.methods.eagle3.examples import build_eagle3_example  # noqa: E402
from peagle.methods.eagle3.ttt import ttt_passes  # noqa: E402
from peagle.objective import PrecomputedMask, collate  # noqa: E402

K = 4


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: threads only add contention (the suite shares a small machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def setup(seed=0, draft_vocab=6):
    """A drafter whose draft vocabulary is small (so deeper drafts sometimes match by chance)."""
    spec = tiny_spec(vocab=40, draft_vocab=draft_vocab)
    drafter, head = make_models(spec, seed=seed)
    drafter.eval()
    g = torch.Generator().manual_seed(seed)
    vocab = vocab_from_ids(torch.randperm(spec.vocab_size - 1, generator=g)[:draft_vocab], spec.vocab_size)
    return spec, drafter, head, vocab


def causal(drafter, tokens, aux, positions, is_mask=None, override=None):
    n = tokens.numel()
    kwargs = {}
    if override is not None:
        kwargs = dict(hidden_override=override[None], override_mask=(override.abs().sum(-1) > 0)[None])
    return drafter(
        input_ids=tokens[None],
        aux_hidden=aux[None],
        position_ids=positions[None],
        attention_mask=torch.ones(n, n, dtype=torch.bool).tril()[None],
        is_mask=None if is_mask is None else is_mask[None],
        **kwargs,
    )


def to_target(vocab, logits):
    ids = logits.argmax(-1)
    return ids + vocab.d2t[ids]


def context(spec, sample, anchor):
    """vLLM's drafter input after anchor p: (x_{a+1}, g_a) at positions 0..p."""
    ht = spec.target_hidden_size
    tokens = sample.token_ids[1 : anchor + 2].clone()
    aux = sample.hidden[: anchor + 1, :3].reshape(anchor + 1, 3 * ht)
    return tokens, aux, torch.arange(anchor + 1)


@torch.no_grad()
def brute_peagle(drafter, spec, vocab, sample, anchor, k=K):
    """Inference-time input: context, then K-1 (mask, mask_hidden) slots; plain causal attention."""
    tokens, aux, positions = context(spec, sample, anchor)
    tokens = torch.cat([tokens, torch.full((k - 1,), spec.mask_token_id)])
    aux = torch.cat([aux, aux.new_zeros(k - 1, aux.shape[1])])
    positions = torch.arange(anchor + k)
    is_mask = positions > anchor
    out = causal(drafter, tokens, aux, positions, is_mask)
    return to_target(vocab, out.logits[0, anchor:])


@torch.no_grad()
def brute_eagle3(drafter, spec, vocab, sample, anchor, k=K):
    """vLLM's sequential EAGLE-3: each step appends (its drafted token, its pre-norm hidden)."""
    tokens, aux, positions = context(spec, sample, anchor)
    override = torch.zeros(anchor + 1, spec.hidden_size)
    drafts = []
    for j in range(k):
        out = causal(drafter, tokens, aux, positions, override=override)
        drafts.append(to_target(vocab, out.logits[0, -1]))
        tokens = torch.cat([tokens, drafts[-1][None]])
        aux = torch.cat([aux, aux.new_zeros(1, aux.shape[1])])
        positions = torch.cat([positions, torch.tensor([anchor + j + 1])])
        override = torch.cat([override, out.hidden[0, -1:]])
    return torch.stack(drafts)


def brute_accepted(drafts, anchor, reference, loss_mask):
    count = 0
    for k, token in enumerate(drafts.tolist(), start=1):
        pos = anchor + 1 + k
        if pos >= reference.numel() or not loss_mask[pos] or token != int(reference[pos]):
            break
        count += 1
    return count


@torch.no_grad()
def self_consistent_sample(spec, drafter, vocab, n=40, seed=0):
    """Tokens x_{q} = the drafter's own first draft after anchor q-2, so acceptance is non-trivial."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, 4, spec.target_hidden_size, generator=g)
    tokens = torch.randint(0, spec.vocab_size - 1, (n,), generator=g)
    loss_mask = torch.ones(n, dtype=torch.bool)
    loss_mask[:6] = False
    loss_mask[22:25] = False  # a second turn: its user tokens are not drafted for
    sample = SimpleNamespace(token_ids=tokens, loss_mask=loss_mask, hidden=hidden)
    for q in range(2, n):
        if loss_mask[q]:
            tokens[q] = brute_peagle(drafter, spec, vocab, sample, q - 2, k=1)[0]
    return sample


def test_drafting_anchors_and_prefix_counting():
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    assert drafting_anchors(mask).tolist() == [1, 2, 5]
    reference = torch.arange(8)
    drafts = torch.tensor([[3, 4, 9], [4, 5, 6], [7, 0, 0]])
    # anchor 1: 3, 4 match, then position 5 is not an assistant token; anchor 2: 4 matches,
    # 5 is outside the mask; anchor 5: 7 matches, then the sequence ends
    assert accepted_counts(drafts, torch.tensor([1, 2, 5]), reference, mask).tolist() == [2, 1, 1]


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_one_pass_drafts_equal_per_anchor_inference(method):
    spec, drafter, head, vocab = setup(seed=1)
    sample = self_consistent_sample(spec, drafter, vocab)
    anchors = drafting_anchors(sample.loss_mask)
    brute = brute_peagle if method == "peagle" else brute_eagle3
    got = draft_tokens(drafter, sample, spec, vocab, anchors, K, method, chunk_anchors=7)
    for row, anchor in enumerate(anchors.tolist()):
        assert torch.equal(got[row], brute(drafter, spec, vocab, sample, anchor)), anchor
    for reference in ("data", "target"):
        ref = reference_tokens(sample, reference, head, vocab)
        counts = accepted_counts(got, anchors, ref, sample.loss_mask)
        want = [brute_accepted(got[r], a, ref, sample.loss_mask) for r, a in enumerate(anchors.tolist())]
        assert counts.tolist() == want
    data_counts = accepted_counts(got, anchors, sample.token_ids, sample.loss_mask)
    assert (data_counts >= 1).float().mean() > 0.8  # first drafts generated the data
    if method == "peagle":
        assert (data_counts >= 2).any()


@torch.no_grad()
def test_eagle3_drafts_equal_the_training_time_test_wherever_the_earlier_drafts_were_right():
    """Training (TTT, ground-truth tokens) and drafting see the same inputs once drafts 1..j are right.

    Then draft j+1 is the training forward's step-j argmax, so P(draft j+1 accepted | drafts
    1..j accepted) over the offline anchors IS the training-mode accuracy at depth j over the
    anchors whose steps 0..j-1 were right. (The logged ``acc/depth_j`` averages over every
    anchor instead; an undertrained head that repeats its parent's draft scores there mostly
    where step j-1 was wrong, so it overstates acceptance at positions >= 2.)
    """
    spec, drafter, head, vocab = setup(seed=3)
    sample = self_consistent_sample(spec, drafter, vocab, n=48)  # every first draft is right
    anchors = drafting_anchors(sample.loss_mask)
    drafts = draft_tokens(drafter, sample, spec, vocab, anchors, K, "eagle3", chunk_anchors=9)
    batch = collate([build_eagle3_example(sample, spec, K, 64)], PrecomputedMask(64, K))
    trained = {}
    for st in ttt_passes(drafter, batch, K):  # training mode: ground-truth tokens at steps >= 1
        ids = to_target(vocab, st.output.logits)
        for a, t in zip(st.batch.anchor[st.logits_mask].tolist(), ids.tolist()):
            trained[(a, st.step)] = t
    tokens, mask = sample.token_ids, sample.loss_mask
    compared, right = [0] * K, [0] * K
    for row, p in enumerate(anchors.tolist()):
        for j in range(K):
            pos = p + 2 + j
            if pos >= tokens.numel() or not mask[pos]:
                break
            assert int(drafts[row, j]) == trained[(p, j)], (p, j)
            compared[j] += 1
            if int(drafts[row, j]) != int(tokens[pos]):
                break
            right[j] += 1
    counts = accepted_counts(drafts, anchors, tokens, mask)
    assert [int((counts > j).sum()) for j in range(K)] == right
    assert compared[1] >= 20 and compared[2] >= 5, compared  # the deep steps were really compared
    assert right[0] == compared[0]  # the sample was built from the first drafts


def brute_walk(drafter, spec, vocab, sample, k, max_tokens=None, drafts_after=None):
    """Decode each generated span as vLLM does: draft after the last token, accept, jump
    (``drafts_after(p)``: the drafts after anchor p; default the drafter's)."""
    mask, out, q = sample.loss_mask.tolist(), [], 0
    while q < len(mask):
        if not mask[q]:
            q += 1
            continue
        last = q
        while last + 1 < len(mask) and mask[last + 1]:
            last += 1
        p, produced = q - 1, 1  # x_q came from prefill; the first draft follows it
        while p + 2 <= last and (max_tokens is None or produced < max_tokens):
            drafts = (drafts_after or (lambda p: brute_peagle(drafter, spec, vocab, sample, p)))(p)[:k]
            a = brute_accepted(drafts, p, sample.token_ids, sample.loss_mask)
            out.append(a)
            p, produced = p + a + 1, produced + a + 1
        q = last + 1
    return out


def test_walk_counts_each_draft_once_and_stops_at_the_budget():
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1], dtype=torch.bool)
    accepted_at = torch.tensor([0, 3, 0, 0, 0, 2, 1, 0, 0, 0, 1, 0, 0, 0])
    # span 2..8: drafts after anchors 1 (3 accepted) and 5 (2), none after 8 (the span's last token);
    # span 11..13: a draft after anchor 10 (1), none after 12 (13 is the last token)
    assert walk_drafts(accepted_at, mask, k=4) == [3, 2, 1]
    assert walk_drafts(accepted_at, mask, k=1) == [1, 0, 0, 1, 1]  # K caps the runs, so the walk visits other anchors
    # a budget of 4 tokens: after anchor 1 the request has x_2..x_5 = 4 tokens and stops drafting;
    # the accepted drafts may run past the budget (vLLM verifies them before truncating)
    assert walk_drafts(accepted_at, mask, k=4, max_tokens=4) == [3, 1]
    assert walk_drafts(accepted_at, mask, k=4, max_tokens=1) == []


def test_evaluate_offline_from_a_shard_store(tmp_path):
    spec, drafter, head, vocab = setup(seed=2)
    samples = [self_consistent_sample(spec, drafter, vocab, n, seed) for n, seed in ((40, 0), (31, 1), (3, 2))]
    with ShardWriter(tmp_path / "eval", [2, 3, 4, 6], spec.target_hidden_size, "float32", 64) as writer:
        for i, s in enumerate(samples):
            writer.add(f"s{i}", s.token_ids, s.loss_mask, s.hidden)
    reader = ShardReader(tmp_path / "eval")
    for max_tokens in (None, 9):
        result = evaluate_offline(drafter, head, reader, spec, vocab, [1, 2, 4], max_samples=3, method="peagle",
                                  max_k=4, max_tokens=max_tokens)
        assert result.num_samples == 3
        for k in (1, 2, 4):
            walk = [a for i in range(len(reader)) for a in brute_walk(drafter, spec, vocab, reader[i], k, max_tokens)]
            assert result.num_drafts[k] == len(walk)
            assert result.acceptance_length[k] == pytest.approx(1 + sum(walk) / len(walk), abs=1e-12)
        walk = torch.tensor(walk)
        assert result.per_position == pytest.approx([(walk >= j).float().mean().item() for j in range(1, 5)],
                                                    abs=1e-12)
        assert result.acceptance_length[1] > 1.8
        assert result.num_drafts[4] < result.num_drafts[1]  # deeper accepted runs skip anchors

    with pytest.raises(ValueError, match="largest K this head can be evaluated at"):
        evaluate_offline(drafter, head, reader, spec, vocab, [5], 3, max_k=4)
    with pytest.raises(ValueError, match="target head"):
        evaluate_offline(drafter, None, reader, spec, vocab, [2], 3, reference="target")


def brute_lookup(ids: list[int], end: int, k: int) -> list[int]:
    """vLLM's prompt lookup by search: the tokens after the latest earlier occurrence of the
    longest suffix (4 down to 2 tokens) of ids[:end], at most k, not past ``end``."""
    for n in (4, 3, 2):
        for start in range(end - n - 1, -1, -1):
            if end >= n and ids[start:start + n] == ids[end - n:end]:
                return ids[start + n:min(start + n + k, end)]
    return []


def repeating_sample(spec, n=60, seed=0):
    """A prompt, then an answer that says one phrase again and again between random tokens."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, spec.vocab_size - 1, (n,), generator=g)
    phrase = tokens[8:14].clone()
    for start in (20, 33, 47):
        tokens[start:start + 6] = phrase
    loss_mask = torch.arange(n) >= 8
    return SimpleNamespace(token_ids=tokens, loss_mask=loss_mask, hidden=torch.randn(n, 4, spec.target_hidden_size,
                                                                                     generator=g))


def test_ngram_lookup_drafts_what_followed_the_longest_earlier_match():
    spec, *_ = setup()
    sample = repeating_sample(spec)
    anchors = drafting_anchors(sample.loss_mask)
    drafts = ngram_drafts(sample.token_ids, anchors, K)
    ids = sample.token_ids.tolist()
    for row, p in enumerate(anchors.tolist()):
        want = brute_lookup(ids, p + 2, K)
        assert drafts[row].tolist() == want + [-1] * (K - len(want)), p
    assert (drafts[:, 0] >= 0).sum() >= 10  # the repeats are found


def test_n_gram_lookup_is_walked_beside_the_head_and_splits_its_hits(tmp_path):
    spec, drafter, head, vocab = setup(seed=2)
    samples = [repeating_sample(spec, seed=s) for s in (0, 1)]
    with ShardWriter(tmp_path / "eval", [2, 3, 4, 6], spec.target_hidden_size, "float32", 64) as writer:
        for i, s in enumerate(samples):
            writer.add(f"s{i}", s.token_ids, s.loss_mask, s.hidden)
    reader = ShardReader(tmp_path / "eval")
    result = evaluate_offline(drafter, head, reader, spec, vocab, [2, 4], method="peagle", max_k=4)
    positions, lookup_right, head_where_right, head_where_wrong = (torch.zeros(K) for _ in range(4))
    for k in (2, 4):
        def lookup_after(p, s, k=k):
            return torch.tensor(brute_lookup(s.token_ids.tolist(), p + 2, k), dtype=torch.long)

        walk = [a for s in samples for a in brute_walk(drafter, spec, vocab, s, k,
                                                       drafts_after=lambda p, s=s: lookup_after(p, s))]
        assert result.ngram_acceptance_length[k] == pytest.approx(1 + sum(walk) / len(walk), abs=1e-12)
    assert result.ngram_acceptance_length[4] > 1.2  # the repeats are copied
    alone = evaluate_offline(drafter, head, reader, spec, vocab, [2, 4], method="peagle", max_k=4, compare_ngram=False)
    assert alone.acceptance_length == result.acceptance_length
    assert not alone.ngram_acceptance_length and not alone.versus_ngram
    for s in samples:
        ids = s.token_ids.tolist()
        for p in drafting_anchors(s.loss_mask).tolist():
            mine = brute_peagle(drafter, spec, vocab, s, p).tolist()
            lookup = brute_lookup(ids, p + 2, K)
            for j in range(K):
                pos = p + 2 + j
                if pos >= len(ids) or not s.loss_mask[pos]:
                    continue
                positions[j] += 1
                hit = j < len(lookup) and lookup[j] == ids[pos]
                lookup_right[j] += hit
                (head_where_right if hit else head_where_wrong)[j] += mine[j] == ids[pos]
    versus = result.versus_ngram
    assert versus["ngram_right"] == pytest.approx((lookup_right / positions).tolist())
    assert versus["head_right_where_ngram_right"] == pytest.approx((head_where_right / lookup_right).tolist())
    assert versus["head_right_where_ngram_wrong"] == pytest.approx(
        (head_where_wrong / (positions - lookup_right)).tolist())


def test_a_true_previous_head_is_evaluated_on_the_inputs_it_trained_with():
    spec, *_ = setup()
    sample = repeating_sample(spec)
    anchors = torch.tensor([9, 12, 30])
    plain = _draft_batch(sample, spec, anchors, K, "cpu")
    oracle = _draft_batch(sample, spec, anchors, K, "cpu", mask_slot_inputs="true_previous")
    deep = oracle.depth[0] > 0
    assert (plain.input_ids[0][deep] == spec.mask_token_id).all()
    want = sample.token_ids[(oracle.anchor[0] + 1 + oracle.depth[0])[deep]]
    assert torch.equal(oracle.input_ids[0][deep], want) and torch.equal(oracle.is_mask, plain.is_mask)
    assert torch.equal(oracle.input_ids[0][~deep], plain.input_ids[0][~deep])
