"""Flex attention's block-sparse path computes what the dense path and the rule pair by pair do.

The three ways the drafter can attend: a Bool [B, N, N] built pair by pair from the rule
(``brute_force_mask``, the reference), the rule evaluated as a dense mask (``ElementAttention.dense``)
and as flex attention's block mask (``ElementAttention.block_mask``). On CPU torch 2.13's flex
attention runs forward only, so flex's gradients are checked on CUDA (``gpu`` tests); the CPU
tests compile flex attention once for the module (two element counts: torch's static kernel,
then its dynamic one), hence ``slow``.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from peagle.methods.eagle3.examples import build_eagle3_example
from peagle.methods.eagle3.loss import eagle3_loss
from peagle.methods.eagle3.ttt import ttt_passes
from peagle.methods.peagle.loss import peagle_loss
from peagle.model import PEagleDrafter, attention_backend, check_attention_backend
from peagle.objective import PrecomputedMask, TargetHead, build_peagle_example, collate
from peagle.objective.batch import Batch
from peagle.objective.masks import brute_force_mask

sys.path.insert(0, str(Path(__file__).parent))  # the drafter tests' tiny spec and samples
from test_drafter import random_sample, randomize, tiny_spec  # noqa: E402

SPEC = tiny_spec(hidden=64)  # 4 query heads sharing 2 KV heads, 16 wide: Triton (flex on CUDA) multiplies no narrower
K = 4
TOLERANCE = 1e-5  # fp32, relative to the largest magnitude compared


def make_batch(seed: int, lengths: tuple[int, ...] = (44, 30)) -> Batch:
    """Two rows: two documents packed (COD sampled), then one document padded to the first row."""
    spec = SPEC
    g = torch.Generator().manual_seed(seed)
    first, second, third = (random_sample(n, spec.target_hidden_size, spec.vocab_size, seed=seed * 10 + i, loss_from=3)
                            for i, n in enumerate((lengths[0], lengths[1], lengths[1] + 10)))
    examples = [build_peagle_example([first, second], spec, K, 0.8, 0.2, 96, g),
                build_peagle_example(third, spec, K, 0.7, 0.2, 96, g)]
    assert len(examples[0]) > len(examples[1])
    return collate(examples, PrecomputedMask(96, K))


def brute_force(batch: Batch) -> torch.Tensor:
    """Bool [B, N, N]: the rule pair by pair, padding masked (the drafter adds the diagonal)."""
    return torch.stack([brute_force_mask(batch.anchor[r], batch.depth[r], batch.doc[r], batch.valid[r])
                        for r in range(batch.input_ids.shape[0])])


def run(drafter, batch: Batch, attention, backend: str = "dense", logits_mask=None):
    drafter.attention = backend
    return drafter(batch.input_ids, batch.aux_hidden, batch.position_ids, attention, batch.is_mask,
                   logits_mask=logits_mask)


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str, tolerance: float = TOLERANCE) -> None:
    error = float((got.cpu() - want).abs().max() / want.abs().max().clamp_min(1e-30))
    assert error < tolerance, f"{what}: relative error {error:.2e}"


def gradients(drafter) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().cpu().clone() for n, p in drafter.named_parameters() if p.grad is not None}
    drafter.zero_grad(set_to_none=True)
    return out


def loss_gradients(drafter, batch: Batch, attention, backend: str):
    """Logits of the supervised elements and every parameter's gradient of a loss that reads all of them."""
    out = run(drafter, batch, attention, backend, logits_mask=batch.supervised)
    weights = torch.linspace(-1, 1, out.logits.numel(), device=out.logits.device).view_as(out.logits)
    ((out.logits * weights).sum() + out.hidden[batch.valid].square().mean()).backward()
    logits = out.logits.detach().cpu()
    return logits, gradients(drafter)


@pytest.fixture(scope="module")
def drafter():
    torch.manual_seed(0)
    return randomize(PEagleDrafter(SPEC))


@pytest.fixture(scope="module")
def batches():
    return [make_batch(seed, lengths) for seed, lengths in ((0, (44, 30)), (1, (60, 21)), (2, (35, 35)))]


# ----------------------------------------------------------------------------- CPU


@pytest.mark.slow
def test_flex_forward_equals_the_dense_path_and_the_rule_pair_by_pair(drafter, batches):
    """Logits and the fed-back hidden states, every element, padding rows included."""
    for batch in batches:
        assert batch.input_ids.shape[1] > 128  # more than one tile: no single-tile kernel to compile
        with torch.no_grad():
            reference = run(drafter, batch, brute_force(batch))
            dense = run(drafter, batch, batch.attention, "dense")
            flex = run(drafter, batch, batch.attention, "flex")
        for name in ("logits", "hidden"):
            assert_close(getattr(dense, name), getattr(reference, name), f"dense {name}")
            assert_close(getattr(flex, name), getattr(reference, name), f"flex {name}")


def test_dense_path_gradients_equal_the_rule_pair_by_pair(drafter, batches):
    """What training runs on CPU (``auto`` = dense): logits and every parameter's gradient."""
    model = copy.deepcopy(drafter).train()
    for batch in batches[:2]:
        want_logits, want = loss_gradients(model, batch, brute_force(batch), "dense")
        got_logits, got = loss_gradients(model, batch, batch.attention, "auto")
        assert_close(got_logits, want_logits, "logits")
        assert got.keys() == want.keys() and len(got) == len(list(model.parameters()))
        for name in want:
            assert_close(got[name], want[name], name)


@pytest.mark.slow
def test_eagle3_steps_with_flex_equal_the_dense_path(drafter):
    """EAGLE-3's training-time-test passes (fed-back hidden states, growing element sets) read the
    same rule: each step's logits agree between the two paths."""
    spec = drafter.spec
    samples = [random_sample(n, spec.target_hidden_size, spec.vocab_size, seed=n, loss_from=2) for n in (50, 38)]
    batch = collate([build_eagle3_example(s, spec, K, 96) for s in samples], PrecomputedMask(96, K))
    with torch.no_grad():
        drafter.attention = "dense"
        dense = [step.output.logits for step in ttt_passes(drafter, batch, K)]
        drafter.attention = "flex"
        flex = [step.output.logits for step in ttt_passes(drafter, batch, K)]
    assert len(flex) == K
    for step, (got, want) in enumerate(zip(flex, dense, strict=True)):
        assert_close(got, want, f"step {step}")


def test_flex_refuses_gradients_on_cpu_and_auto_picks_dense_there(drafter, batches):
    assert attention_backend("auto", torch.device("cpu")) == "dense"
    assert attention_backend("auto", torch.device("cuda")) == "flex"
    assert attention_backend("dense", torch.device("cuda")) == "dense"
    check_attention_backend("auto", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"train.launch.attention: flex cannot train on cpu.*set train.launch.attention: auto"):
        check_attention_backend("flex", torch.device("cpu"))
    model = copy.deepcopy(drafter).train()
    with pytest.raises(RuntimeError, match="flex attention cannot compute gradients on cpu"):
        run(model, batches[0], batches[0].attention, "flex")


def test_a_rule_for_other_elements_is_named(drafter, batches):
    batch = batches[0]
    with pytest.raises(ValueError, match="attention rule covers"):
        run(drafter, batch, batches[1].attention)


# ----------------------------------------------------------------------------- CUDA

CUDA_TOLERANCE = 1e-4  # fp32 on two devices: different summation orders, no TF32


def on_cuda(drafter: PEagleDrafter, backend: str) -> PEagleDrafter:
    model = copy.deepcopy(drafter).train().cuda()
    model.attention = backend
    return model


@pytest.mark.gpu
def test_flex_on_cuda_equals_dense_on_cpu_logits_and_gradients(drafter, batches):
    """Training's path on a GPU (``auto`` = flex): logits and every parameter's gradient, batches
    of three element counts (the static kernel, then the dynamic one)."""
    cpu = copy.deepcopy(drafter).train()
    gpu = on_cuda(drafter, "auto")
    for batch in batches:
        want_logits, want = loss_gradients(cpu, batch, brute_force(batch), "dense")
        cuda_batch = batch.to("cuda")
        got_logits, got = loss_gradients(gpu, cuda_batch, cuda_batch.attention, "auto")
        assert_close(got_logits, want_logits, "logits", CUDA_TOLERANCE)
        assert got.keys() == want.keys() and len(got) == len(list(cpu.parameters()))
        for name in want:
            assert_close(got[name], want[name], name, CUDA_TOLERANCE)


@pytest.mark.gpu
def test_eagle3_loss_with_flex_on_cuda_equals_dense_on_cpu(drafter):
    spec = drafter.spec
    samples = [random_sample(n, spec.target_hidden_size, spec.vocab_size, seed=n, loss_from=2) for n in (50, 38)]
    batch = collate([build_eagle3_example(s, spec, K, 96) for s in samples], PrecomputedMask(96, K))
    head = TargetHead(spec.target_hidden_size, spec.draft_vocab_size, spec.rms_norm_eps)
    cpu = copy.deepcopy(drafter).train()
    cpu.attention = "dense"
    eagle3_loss(cpu, head, batch, K).loss.backward()
    want = gradients(cpu)
    gpu = on_cuda(drafter, "flex")
    eagle3_loss(gpu, copy.deepcopy(head).cuda(), batch.to("cuda"), K).loss.backward()
    got = gradients(gpu)
    assert got.keys() == want.keys()
    for name in want:
        assert_close(got[name], want[name], name, CUDA_TOLERANCE)


@pytest.mark.gpu
def test_flex_on_cuda_trains_in_bf16(drafter, batches):
    """DeepSpeed's bf16 casts the drafter: the flex path runs there, with finite gradients."""
    model = on_cuda(drafter, "flex").to(torch.bfloat16)
    head = TargetHead(model.spec.target_hidden_size, model.spec.draft_vocab_size, model.spec.rms_norm_eps).cuda()
    batch = batches[0].to("cuda", torch.bfloat16)
    out = peagle_loss(model, head.to(torch.bfloat16), batch, k=K)
    out.loss.backward()
    assert torch.isfinite(out.loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
