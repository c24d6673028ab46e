"""EAGLE-3 baseline (training-time test): equals vLLM-style sequential drafting, and learns."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "objective"))  # shared tiny-model helpers (importlib mode)
from test_partition import grads, make_models, max_rel_error, one_thread, random_sample, tiny_spec  # noqa: E402,F401

from peagle.config import TrainConfig  # noqa: E402
from peagle.methods.eagle3 import METHOD as EAGLE3  # noqa: E402
from peagle.methods.eagle3.examples import build_eagle3_example
from peagle.methods.eagle3.loss import eagle3_loss
from peagle.methods.eagle3.ttt import ttt_passes
from peagle.objective import PrecomputedMask, build_peagle_example, collate  # noqa: E402
from peagle.objective.loss import TargetHead  # noqa: E402
from tests.support.partition import partition_batch  # noqa: E402


def causal_drafter_pass(drafter, tokens, aux, positions, override=None):
    """Plain causal forward over one sequence of slots (what vLLM's KV cache computes)."""
    n = tokens.numel()
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None]
    override_mask = None
    if override is not None:
        override_mask = torch.tensor([o is not None for o in override])[None]
        override = torch.stack([o if o is not None else torch.zeros(drafter.spec.hidden_size) for o in override])[None]
    return drafter(
        input_ids=tokens[None],
        aux_hidden=aux[None],
        position_ids=positions[None],
        attention_mask=mask,
        hidden_override=override,
        override_mask=override_mask,
    )


def sequential_eagle3(drafter, sample, anchor: int, steps: int):
    """Reference: EAGLE-3 drafting after ``anchor`` one slot per pass, fed ground-truth tokens."""
    ht = drafter.spec.target_hidden_size
    tokens = sample.token_ids[1 : anchor + 2].clone()
    aux = sample.hidden[: anchor + 1, :3].reshape(anchor + 1, 3 * ht)
    positions = torch.arange(anchor + 1)
    override: list = [None] * (anchor + 1)
    logits = []
    for j in range(steps):
        out = causal_drafter_pass(drafter, tokens, aux, positions, override)
        logits.append(out.logits[0, -1])
        # next slot: ground-truth token x_{p+j+2}, own pre-norm hidden, position p+j+1
        tokens = torch.cat([tokens, sample.token_ids[anchor + j + 2 : anchor + j + 3]])
        aux = torch.cat([aux, aux.new_zeros(1, 3 * ht)])
        positions = torch.cat([positions, torch.tensor([anchor + j + 1])])
        override.append(out.hidden[0, -1])
    return torch.stack(logits)


def test_ground_truth_tokens_are_the_next_real_tokens_even_when_packed():
    spec = tiny_spec()
    docs = [random_sample(spec, 20, 1, 3), random_sample(spec, 15, 2, 4)]
    example = build_eagle3_example(docs, spec, 4, 64)
    assert not example.is_mask.any()
    offsets = [0, 19]
    for e in range(len(example)):
        d, a, doc = int(example.depth[e]), int(example.anchor[e]), int(example.doc[e])
        p = a - offsets[doc]
        assert int(example.input_ids[e]) == int(docs[doc].token_ids[p + d + 1])
        assert int(example.position_ids[e]) == p + d


def test_step_zero_equals_peagle_depth_zero():
    spec, steps = tiny_spec(), 4
    drafter, head = make_models(spec, seed=3)
    sample = random_sample(spec, 50, 5)
    mask = PrecomputedMask(64, 6)
    peagle = collate([build_peagle_example(sample, spec, 6, 0.8, 0.2, 64, torch.Generator().manual_seed(1))], mask)
    eagle = collate([build_eagle3_example(sample, spec, steps, 64)], mask)
    with torch.no_grad():
        p_out = drafter(
            input_ids=peagle.input_ids,
            aux_hidden=peagle.aux_hidden,
            position_ids=peagle.position_ids,
            attention_mask=peagle.attention_mask,
            is_mask=peagle.is_mask,
        )
        step0 = next(ttt_passes(drafter, eagle, steps))
    p_zero = peagle.depth[0] == 0
    e_zero = step0.batch.depth[0] == 0
    assert torch.equal(peagle.anchor[0, p_zero], step0.batch.anchor[0, e_zero])
    torch.testing.assert_close(step0.output.hidden[0, e_zero], p_out.hidden[0, p_zero], rtol=1e-5, atol=1e-5)
    want = p_out.logits[0, p_zero][step0.batch.supervised[0, e_zero]]
    torch.testing.assert_close(step0.output.logits, want, rtol=1e-5, atol=1e-5)


def test_ttt_steps_equal_sequential_drafting_with_kv_cache_semantics():
    spec, steps = tiny_spec(), 4
    drafter, _ = make_models(spec, seed=4)
    sample = random_sample(spec, 30, 6, prompt=0)  # all supervised: every chain is complete
    batch = collate([build_eagle3_example(sample, spec, steps, 64)], PrecomputedMask(64, steps))
    with torch.no_grad():
        passes = list(ttt_passes(drafter, batch, steps))
        for anchor in (0, 7, 25):
            want = sequential_eagle3(drafter, sample, anchor, steps)
            for st in passes:
                rows = st.batch.anchor[0][st.logits_mask[0]]
                got = st.output.logits[rows == anchor]
                assert got.shape[0] == 1, (anchor, st.step)
                torch.testing.assert_close(got[0], want[st.step], rtol=1e-4, atol=1e-5)


def test_partitioned_eagle3_gradients_equal_single_pass():
    spec, steps = tiny_spec(), 3
    drafter, head = make_models(spec, seed=5)
    examples = [build_eagle3_example(random_sample(spec, n, n), spec, steps, 64) for n in (40, 57)]
    batch = collate(examples, PrecomputedMask(64, steps))
    eagle3_loss(drafter, head, batch, steps).loss.backward()
    ref = grads(drafter)
    for part in partition_batch(batch, 3):
        eagle3_loss(drafter, head, part, steps, denominator=batch.num_supervised).loss.backward()
    assert max_rel_error(grads(drafter), ref) < 1e-5


def synthetic_problem(spec, n=64, seed=0):
    """Tokens follow x_{t+1} = 5 x_t + 3 (mod V-1); the target's final state says x_{t+1}."""
    g = torch.Generator().manual_seed(seed)
    v, ht = spec.vocab_size - 1, spec.target_hidden_size
    table = torch.randn(v, ht, generator=g)
    tokens = torch.empty(n, dtype=torch.long)
    tokens[0] = 1
    for t in range(1, n):
        tokens[t] = (5 * tokens[t - 1] + 3) % v
    final = table[torch.cat([tokens[1:], tokens[:1]])]  # state at t encodes x_{t+1}
    aux = torch.stack([table[tokens], 0.5 * table[tokens], torch.randn(n, ht, generator=g)], 1)
    loss_mask = torch.ones(n, dtype=torch.bool)
    loss_mask[:8] = False
    sample = SimpleNamespace(token_ids=tokens, loss_mask=loss_mask, hidden=torch.cat([aux, final[:, None]], 1))
    head = TargetHead(ht, spec.draft_vocab_size, spec.rms_norm_eps)
    with torch.no_grad():  # the draft vocabulary is target ids 0..Vd-1
        head.lm_head.weight.copy_(4.0 * table[: spec.draft_vocab_size] / table[: spec.draft_vocab_size].norm(dim=1, keepdim=True))
    return sample, head


def test_loss_falls_on_a_tiny_problem():
    spec = tiny_spec(vocab=40, draft_vocab=39)
    steps = 3
    drafter, _ = make_models(spec, seed=0)
    sample, head = synthetic_problem(spec)
    batch = collate([build_eagle3_example(sample, spec, steps, 64)], PrecomputedMask(64, steps))
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        out = eagle3_loss(drafter, head, batch, steps)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert losses[-1] < 0.3 * losses[0], losses
    assert set(out.metrics) >= {"loss/depth_0", "loss/depth_2", "acc"}
    assert out.depth_stats["count"].shape == (steps,)


def test_objective_plugs_into_the_trainer():
    spec = tiny_spec()
    drafter, head = make_models(spec, seed=2)
    train = TrainConfig(method="eagle3", eagle3={"ttt_steps": 3}, recipe={"max_len": 64, "segments": 2},
                        peagle={"k_train": 4})
    obj = EAGLE3.objective(train, spec, head)
    assert obj.name == "eagle3" and obj.depths == 3
    g = torch.Generator().manual_seed(0)
    examples = [obj.make_example(random_sample(spec, n, n), g) for n in (30, 45)]
    denom = obj.denominator(examples)
    whole = obj.loss(drafter, obj.collate(examples), denom)
    whole.loss.backward()
    ref = grads(drafter)
    parts = list(obj.batches(examples, train.recipe.segments))
    assert len(parts) == train.recipe.segments
    total = 0.0
    for part in parts:
        out = obj.loss(drafter, part, denom)
        out.loss.backward()
        total += out.loss.item()
    assert total == pytest.approx(whole.loss.item(), rel=1e-5)
    assert max_rel_error(grads(drafter), ref) < 1e-5
    # same loss definition as P-EAGLE: uniform KL mean over the charged elements
    assert whole.num_supervised == denom


def test_unaccepted_weight_leaves_out_the_steps_after_a_miss():
    """As for P-EAGLE (tests/objective/test_loss.py): a TTT step's loss where an earlier step of the
    same anchor drafted wrong is weighted by ``unaccepted_weight``; the statistics count it."""
    from test_loss import reached_by_verification

    from peagle.objective.loss import forward_kl

    spec, steps = tiny_spec(draft_vocab=2), 3  # two draft tokens: about half the drafts miss
    drafter, head = make_models(spec, seed=7)
    examples = [build_eagle3_example(random_sample(spec, n, n), spec, steps, 64) for n in (40, 33)]
    batch = collate(examples, PrecomputedMask(64, steps))
    logits, target, row, anchor, depth = [], [], [], [], []
    with torch.no_grad():
        for st in ttt_passes(drafter, batch, steps):
            logits.append(st.output.logits)
            target.append(head(st.batch.target_hidden[st.logits_mask]))
            row.append(torch.nonzero(st.logits_mask)[:, 0])
            anchor.append(st.batch.anchor[st.logits_mask])
            depth.append(st.batch.depth[st.logits_mask])
    logits, target, depth = torch.cat(logits), torch.cat(target), torch.cat(depth)
    reached = reached_by_verification(logits.argmax(-1) == target.argmax(-1), torch.cat(row), torch.cat(anchor), depth)
    assert reached[depth == 0].all() and 0 < int(reached[depth > 0].sum()) < int((depth > 0).sum())
    kl = forward_kl(logits, target)
    got = eagle3_loss(drafter, head, batch, steps, unaccepted_weight=0.0)
    torch.testing.assert_close(got.loss, (kl * reached).sum() / kl.numel())
    assert got.metrics == eagle3_loss(drafter, head, batch, steps).metrics
