"""Compact batches (token-level hidden states, the mask evaluated when read) train exactly as
the per-element batches they replace: same features, same mask, bit-identical loss and gradients."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from peagle.facts import HeadSpec
from peagle.methods.peagle.loss import peagle_loss
from peagle.model import PEagleDrafter
from peagle.objective import PrecomputedMask, TargetHead, build_peagle_example, collate, kl_loss
from peagle.objective.masks import brute_force_mask
from tests.support.partition import partitioned_loss_backward

HT, K = 16, 5
SPEC = HeadSpec(
    target="tiny", target_revision=None, target_num_layers=6, target_hidden_size=HT, vocab_size=64,
    aux_layer_ids=[2, 3, 4], final_layer_id=6, mask_token_id=63, hidden_size=HT, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=4, intermediate_size=32, rms_norm_eps=1e-6,
    rope_theta=10000.0, rope_scaling=None, max_position_embeddings=256, draft_vocab_size=40,
)


def samples(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (41, 23, 30):
        out.append(SimpleNamespace(
            token_ids=torch.randint(0, 62, (n,), generator=g),
            loss_mask=torch.arange(n) >= n // 5,
            hidden=torch.randn(n, 4, HT, generator=g),
        ))
    return out


def examples(seed: int = 0):
    a, b, c = samples(seed)
    g = torch.Generator().manual_seed(seed)
    return [build_peagle_example(a, SPEC, K, 0.8, 0.3, 64, g), build_peagle_example([b, c], SPEC, K, 0.8, 0.3, 64, g)]


def reference_features(example, docs):
    """Per-element aux and target states straight from the method note (one element at a time)."""
    starts = torch.tensor([0] + [d.token_ids.numel() - 1 for d in docs]).cumsum(0)  # first anchor of each doc
    aux, target = [], []
    for anchor, depth, doc, sup in zip(example.anchor.tolist(), example.depth.tolist(), example.doc.tolist(),
                                       example.supervised.tolist()):
        hidden = docs[doc].hidden.float()
        p = anchor - int(starts[doc])  # anchor inside its own document
        aux.append(hidden[p, :3].reshape(-1) if depth == 0 else torch.zeros(3 * HT))
        target.append(hidden[p + 1 + depth, 3] if sup else torch.zeros(HT))
    return torch.stack(aux), torch.stack(target)


def test_features_are_the_method_notes_per_element_states():
    a, b, c = samples()
    for ex, docs in zip(examples(), ([a], [b, c])):
        aux, target = reference_features(ex, docs)
        assert torch.equal(ex.aux_hidden, aux) and torch.equal(ex.target_hidden, target)
    batch = collate(examples(), PrecomputedMask(64, K))
    for row, (ex, docs) in enumerate(zip(examples(), ([a], [b, c]))):
        aux, target = reference_features(ex, docs)
        n = len(ex)
        assert torch.equal(batch.aux_hidden[row, :n], aux) and torch.equal(batch.target_hidden[row, :n], target)
        assert not batch.aux_hidden[row, n:].any() and not batch.target_hidden[row, n:].any()


def models():
    torch.manual_seed(0)
    drafter = PEagleDrafter(SPEC)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0.0, 0.15)
    head = TargetHead(HT, SPEC.draft_vocab_size, SPEC.rms_norm_eps)
    with torch.no_grad():
        head.lm_head.weight.normal_(0.0, 0.5)
    return drafter, head


def grads(drafter):
    out = {n: p.grad.detach().clone() for n, p in drafter.named_parameters() if p.grad is not None}
    drafter.zero_grad(set_to_none=True)
    return out


def reference_loss(drafter, head, exs, docs_per_example):
    """The loss of the per-element layout: dense per-example masks and copied features, padded."""
    n = max(len(e) for e in exs)
    b = len(exs)

    def pad(values, width):
        out = torch.zeros(b, n, *width) if values[0].is_floating_point() else torch.zeros(b, n, dtype=values[0].dtype)
        for i, v in enumerate(values):
            out[i, : v.shape[0]] = v
        return out

    feats = [reference_features(e, d) for e, d in zip(exs, docs_per_example)]
    aux, target = pad([f[0] for f in feats], (3 * HT,)), pad([f[1] for f in feats], (HT,))
    mask = torch.zeros(b, n, n, dtype=torch.bool)
    for i, e in enumerate(exs):
        mask[i, : len(e), : len(e)] = brute_force_mask(e.anchor, e.depth, e.doc)
    supervised = pad([e.supervised for e in exs], ())
    out = drafter(pad([e.input_ids for e in exs], ()), aux, pad([e.position_ids for e in exs], ()), mask,
                  pad([e.is_mask for e in exs], ()), logits_mask=supervised)
    with torch.no_grad():
        target_logits = head(target[supervised])
    return kl_loss(out.logits, target_logits, pad([e.depth for e in exs], ())[supervised], K)


def test_loss_and_gradients_are_bit_identical_to_the_per_element_layout():
    a, b, c = samples()
    drafter, head = models()
    want = reference_loss(drafter, head, examples(), ([a], [b, c]))
    want.loss.backward()
    want_grads = grads(drafter)
    got = peagle_loss(drafter, head, collate(examples(), PrecomputedMask(64, K)), k=K)
    got.loss.backward()
    got_grads = grads(drafter)
    assert torch.equal(got.loss, want.loss) and got.num_supervised == want.num_supervised > 0
    assert got_grads.keys() == want_grads.keys()
    assert all(torch.equal(got_grads[name], want_grads[name]) for name in want_grads)
    # Algorithm 1's segments read the same compact batches: still the single-pass gradients
    partitioned_loss_backward(drafter, head, examples(), 3, k=K)
    seg = grads(drafter)
    assert all(torch.allclose(seg[name], want_grads[name], rtol=1e-4, atol=1e-6) for name in want_grads)


def test_one_example_batch_shares_the_samples_hidden_states():
    """No per-element or per-batch copy of hidden states: batch prep costs index vectors."""
    a, _, _ = samples()
    ex = build_peagle_example(a, SPEC, K, 0.8, 0.3, 64, torch.Generator().manual_seed(0))
    batch = collate([ex], PrecomputedMask(64, K))
    assert batch.hidden.data_ptr() == a.hidden.data_ptr() == ex.hidden.data_ptr()
    assert all(getattr(batch, name).shape == (1, len(ex)) for name in ("input_ids", "anchor", "depth", "hidden_row"))
