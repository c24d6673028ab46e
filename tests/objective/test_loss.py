"""Forward KL(target || drafter) over the draft vocabulary, its weightings and metrics."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from peagle.facts import HeadSpec
from peagle.methods.peagle.loss import peagle_loss
from peagle.model import PEagleDrafter
from peagle.objective import PrecomputedMask, TargetHead, build_peagle_example, collate, forward_kl, kl_loss
from peagle.objective.loss import Depth0Share, chain_accepted

HT = 16
SPEC = HeadSpec(
    target="tiny", target_revision=None, target_num_layers=6, target_hidden_size=HT, vocab_size=64,
    aux_layer_ids=[2, 3, 4], final_layer_id=6, mask_token_id=63, hidden_size=HT, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=4, intermediate_size=32, rms_norm_eps=1e-6,
    rope_theta=10000.0, rope_scaling=None, max_position_embeddings=256, draft_vocab_size=40,
)


def make_batch(seed=0, k=4, lengths=(30, 18)):
    g = torch.Generator().manual_seed(seed)
    examples = []
    for n in lengths:
        s = SimpleNamespace(
            token_ids=torch.randint(0, 62, (n,), generator=g),
            loss_mask=torch.arange(n) >= 4,
            hidden=torch.randn(n, 4, HT, generator=g),
        )
        examples.append(build_peagle_example(s, SPEC, k, 0.8, 0.3, 64, g))
    return collate(examples, PrecomputedMask(64, k))


def test_forward_kl_matches_torch_distributions():
    g = torch.Generator().manual_seed(0)
    p, q = torch.randn(7, 40, generator=g), torch.randn(7, 40, generator=g)
    want = torch.distributions.kl_divergence(
        torch.distributions.Categorical(logits=q), torch.distributions.Categorical(logits=p)
    )
    torch.testing.assert_close(forward_kl(p, q), want)


def test_loss_is_zero_when_the_drafter_reproduces_the_target():
    torch.manual_seed(0)
    drafter = PEagleDrafter(SPEC).eval()
    batch = make_batch()
    head = TargetHead(HT, 40, SPEC.rms_norm_eps)
    with torch.no_grad():
        head.norm.weight.copy_(drafter.norm.weight)
        head.lm_head.weight.copy_(drafter.lm_head.weight * 1.0)
        drafter.lm_head.weight.mul_(30)  # sharp distributions so top-1 agreement is meaningful
        head.lm_head.weight.mul_(30)
        out = drafter(batch.input_ids, batch.aux_hidden, batch.position_ids, batch.attention_mask, batch.is_mask)
        sup = batch.supervised
        # the drafter's own pre-norm state as "target" (batches hold token-level targets, so score directly)
        result = kl_loss(out.logits[sup], head(out.hidden[sup]), batch.depth[sup], k=4)
    assert result.loss.abs() < 1e-5
    assert result.num_supervised == batch.num_supervised > 0
    assert all(result.metrics[f"acc/depth_{d}"] == 1.0 for d in range(4))
    perturbed = make_batch(seed=1)
    assert peagle_loss(drafter, head, perturbed, k=4).loss > 1e-3


def test_per_depth_accuracy_and_loss():
    target = torch.eye(5).repeat(4, 1) * 10  # argmax = row % 5
    draft = target.clone()
    depth = torch.tensor([0] * 10 + [1] * 10)
    draft[10:15] = draft[10:15].roll(1, dims=1)  # half of depth 1 disagrees
    out = kl_loss(draft, target, depth, k=3)
    assert out.metrics["acc/depth_0"] == 1.0 and out.metrics["acc/depth_1"] == 0.5
    assert "acc/depth_2" not in out.metrics
    assert out.metrics["loss/depth_0"] == pytest.approx(0.0, abs=1e-6) and out.metrics["loss/depth_1"] > 0
    assert out.metrics["acc"] == 0.75
    assert out.depth_stats["count"].tolist() == [10.0, 10.0, 0.0]


def test_uniform_and_per_depth_mean_weightings():
    g = torch.Generator().manual_seed(2)
    draft, target = torch.randn(12, 9, generator=g), torch.randn(12, 9, generator=g)
    depth = torch.tensor([0] * 8 + [1] * 3 + [2])
    kl = forward_kl(draft, target)
    uniform = kl_loss(draft, target, depth, 3, "uniform")
    per_depth = kl_loss(draft, target, depth, 3, "per_depth_mean")
    torch.testing.assert_close(uniform.loss, kl.mean())
    torch.testing.assert_close(per_depth.loss, (kl[:8].mean() + kl[8:11].mean() + kl[11]) / 3)
    share = kl_loss(draft, target, depth, 3, Depth0Share(0.6))  # depth 0 vs all parallel depths together
    torch.testing.assert_close(share.loss, 0.6 * kl[:8].mean() + 0.4 * kl[8:].mean())
    with pytest.raises(ValueError, match="weighting"):
        kl_loss(draft, target, depth, 3, "decay")


@pytest.mark.parametrize("weighting", ["uniform", "per_depth_mean", Depth0Share(0.5)])
def test_external_denominator_makes_partial_sums_add_up(weighting):
    g = torch.Generator().manual_seed(3)
    draft = torch.randn(20, 9, generator=g, requires_grad=True)
    target = torch.randn(20, 9, generator=g)
    depth = torch.randint(0, 4, (20,), generator=g)
    full = kl_loss(draft, target, depth, 4, weighting)
    (full_grad,) = torch.autograd.grad(full.loss, draft)
    denominator = 20.0 if weighting == "uniform" else torch.bincount(depth, minlength=4).float()
    parts = [kl_loss(draft[i], target[i], depth[i], 4, weighting, denominator) for i in (slice(0, 7), slice(7, 20))]
    total = parts[0].loss + parts[1].loss
    (part_grad,) = torch.autograd.grad(total, draft)
    torch.testing.assert_close(total, full.loss)
    torch.testing.assert_close(part_grad, full_grad)


def test_empty_supervision_gives_a_zero_loss_with_a_graph():
    draft = torch.randn(0, 9, requires_grad=True)
    out = kl_loss(draft, torch.randn(0, 9), torch.zeros(0, dtype=torch.long), 3)
    assert out.loss.item() == 0.0 and out.loss.requires_grad and out.num_supervised == 0


def test_gradients_reach_the_mask_placeholders_not_the_target_head():
    torch.manual_seed(0)
    drafter = PEagleDrafter(SPEC)
    head = TargetHead(HT, 40, SPEC.rms_norm_eps)
    batch = make_batch(seed=4)
    peagle_loss(drafter, head, batch, k=4).loss.backward()
    assert drafter.mask_hidden.grad.abs().sum() > 0
    assert drafter.embed_tokens.weight.grad[SPEC.mask_token_id].abs().sum() > 0
    assert all(p.grad is None for p in head.parameters())


@pytest.mark.parametrize("tie", [False, True])
def test_target_head_reproduces_the_target_logits(tmp_path, tie):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=HT, intermediate_size=32, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tie, rms_norm_eps=1e-6,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.copy_(1 + 0.3 * torch.randn(HT))
    model.save_pretrained(tmp_path)
    captured = {}
    model.model.norm.register_forward_hook(lambda mod, args, out: captured.update(prenorm=args[0]))
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        logits = model(ids).logits[0]
    draft_ids = torch.tensor([0, 3, 5, 8, 13, 21, 34, 55])
    spec = HeadSpec(**{**SPEC.__dict__, "draft_vocab_size": 8})
    head = TargetHead.from_target(str(tmp_path), spec, draft_ids)
    with torch.no_grad():
        got = head(captured["prenorm"][0])  # the stored final layer is the pre-norm residual stream
    torch.testing.assert_close(got, logits[:, draft_ids], rtol=1e-5, atol=1e-5)
    assert not any(p.requires_grad for p in head.parameters())


def reached_by_verification(correct, row, anchor, depth) -> torch.Tensor:
    """Reference: greedy verification reads a draft iff no shallower draft of its anchor missed."""
    first_miss: dict[tuple[int, int], int] = {}
    for c, r, a, d in zip(correct.tolist(), row.tolist(), anchor.tolist(), depth.tolist()):
        if not c:
            first_miss[(r, a)] = min(first_miss.get((r, a), d), d)
    return torch.tensor([d <= first_miss.get((r, a), d) for r, a, d in zip(row.tolist(), anchor.tolist(), depth.tolist())])


def test_chain_accepted_follows_each_anchors_shallower_drafts():
    correct = torch.tensor([True, False, True, True, True, False, True])
    row = torch.tensor([0, 0, 0, 0, 0, 1, 1])
    anchor = torch.tensor([3, 3, 3, 4, 4, 3, 3])
    depth = torch.tensor([0, 1, 2, 0, 1, 0, 1])
    want = [True, True, False, True, True, True, False]  # a miss blocks the deeper drafts of its own anchor and row only
    assert chain_accepted(correct, row, anchor, depth).tolist() == want
    assert reached_by_verification(correct, row, anchor, depth).tolist() == want


@pytest.mark.parametrize("weight", [0.0, 0.25])
def test_unaccepted_weight_charges_the_drafts_verification_never_reads_less(weight):
    spec = replace(SPEC, draft_vocab_size=2)  # two draft tokens: about half the drafts miss
    torch.manual_seed(0)
    drafter = PEagleDrafter(spec)
    head = TargetHead(HT, 2, SPEC.rms_norm_eps)
    with torch.no_grad():
        head.lm_head.weight.normal_(0.0, 1.0)
    batch = make_batch(seed=5)
    sup = batch.supervised
    with torch.no_grad():
        out = drafter(batch.input_ids, batch.aux_hidden, batch.position_ids, batch.attention_mask, batch.is_mask,
                      logits_mask=sup)
        target = head(batch.target_hidden[sup])
    depth = batch.depth[sup]
    reached = reached_by_verification(out.logits.argmax(-1) == target.argmax(-1), torch.nonzero(sup)[:, 0],
                                      batch.anchor[sup], depth)
    assert reached[depth == 0].all() and 0 < int(reached[depth > 0].sum()) < int((depth > 0).sum())
    kl = forward_kl(out.logits, target)
    got = peagle_loss(drafter, head, batch, "uniform", k=4, unaccepted_weight=weight)
    torch.testing.assert_close(got.loss, (kl * torch.where(reached, 1.0, weight)).sum() / kl.numel())
    plain = peagle_loss(drafter, head, batch, "uniform", k=4)
    torch.testing.assert_close(plain.loss, kl.mean())
    assert got.metrics == plain.metrics  # the statistics still count every element


def test_cross_entropy_trains_on_the_targets_greedy_token_and_reports_the_kl():
    g = torch.Generator().manual_seed(1)
    draft, target = torch.randn(9, 40, generator=g), torch.randn(9, 40, generator=g)
    depth = torch.tensor([0, 0, 0, 1, 1, 2, 2, 3, 3])
    ce = kl_loss(draft, target, depth, 4, "uniform", kind="cross_entropy")
    kl = kl_loss(draft, target, depth, 4, "uniform")
    torch.testing.assert_close(ce.loss, torch.nn.functional.cross_entropy(draft, target.argmax(-1)))
    torch.testing.assert_close(kl.loss, forward_kl(draft, target).mean())
    assert ce.metrics == kl.metrics  # the statistics are the KL and top-1 agreement either way
    with pytest.raises(ValueError, match="'kl' or 'cross_entropy'"):
        kl_loss(draft, target, depth, 4, "uniform", kind="mse")
