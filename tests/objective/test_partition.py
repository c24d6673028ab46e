"""Sequence partitioning (Algorithm 1): segments cover every element once, gradients are exact."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from peagle.facts import HeadSpec
from peagle.methods.peagle.loss import peagle_loss
from peagle.model import PEagleDrafter
from peagle.objective import PrecomputedMask, TargetHead, build_peagle_example, collate
from peagle.objective.loss import Depth0Share
from peagle.objective.masks import brute_force_mask
from peagle.objective.partition import owner_segment, partition_example, segment_boundaries
from tests.support.partition import partition_batch, partitioned_loss_backward


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: threads only add contention (the suite shares a small machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_spec(hidden=32, target_hidden=24, layers=2, vocab=80, draft_vocab=40, heads=4, kv_heads=2) -> HeadSpec:
    return HeadSpec(
        target="tiny",
        target_revision=None,
        target_num_layers=6,
        target_hidden_size=target_hidden,
        vocab_size=vocab,
        aux_layer_ids=[2, 3, 4],
        final_layer_id=6,
        mask_token_id=vocab - 1,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        intermediate_size=2 * hidden,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=1 << 16,
        draft_vocab_size=draft_vocab,
    )


def random_sample(spec: HeadSpec, n: int, seed: int, prompt: int | None = None):
    g = torch.Generator().manual_seed(seed)
    loss_mask = torch.ones(n, dtype=torch.bool)
    loss_mask[: prompt if prompt is not None else n // 4] = False
    return SimpleNamespace(
        token_ids=torch.randint(0, spec.vocab_size - 1, (n,), generator=g),
        loss_mask=loss_mask,
        hidden=torch.randn(n, 4, spec.target_hidden_size, generator=g),
    )


def make_models(spec: HeadSpec, seed: int = 0):
    torch.manual_seed(seed)
    drafter = PEagleDrafter(spec)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    head = TargetHead(spec.target_hidden_size, spec.draft_vocab_size, spec.rms_norm_eps)
    with torch.no_grad():
        head.lm_head.weight.normal_(0.0, 0.5)
    return drafter, head


def grads(drafter) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in drafter.named_parameters() if p.grad is not None}
    drafter.zero_grad(set_to_none=True)
    return out


def max_rel_error(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-30)) for n in a)


# ----------------------------------------------------------------------------- structure


def test_boundaries_follow_algorithm_1_and_an_anchors_chain_stays_together():
    assert segment_boundaries(10, 3) == [0, 3, 6, 10]
    anchor = torch.tensor([0, 2, 3, 9, 2, 5, 8, 2])  # the elements' depths: 0, 0, 0, 0, 1, 1, 1, 2
    # every depth -> the segment of its anchor (Algorithm 1 would send anchor 2's depths 1, 2 to segment 1)
    assert owner_segment(anchor, [0, 3, 6, 10]).tolist() == [0, 0, 1, 2, 0, 1, 2, 0]


@pytest.mark.parametrize("segments", [1, 2, 3, 5])
def test_every_element_is_charged_once_and_sees_its_whole_context(segments):
    spec = tiny_spec()
    example = build_peagle_example(random_sample(spec, 61, 1), spec, 5, 0.8, 0.2, 64, torch.Generator().manual_seed(3))
    parts = partition_example(example, segments)
    assert len(parts) == segments
    owned = torch.cat([p.index[p.owned] for p in parts]).sort().values
    assert torch.equal(owned, torch.arange(len(example)))
    full = brute_force_mask(example.anchor, example.depth, example.doc)
    for p in parts:
        # every key an owned element may attend to is inside its segment
        needed = full[p.index[p.owned]].any(0)
        assert torch.isin(torch.nonzero(needed).squeeze(1), p.index).all()
        # context elements are depth 0 before the segment's end; they are never charged
        ctx = ~p.owned
        assert (p.example.depth[ctx] == 0).all() and (p.example.anchor[ctx] < p.end).all()
        assert not p.example.supervised[ctx].any()
        # depth-major order is kept (precomputed masks take their fast path)
        assert torch.equal(p.index, p.index.sort().values)


# ----------------------------------------------------------------------------- gradients


def reference_grads(drafter, head, batch, weighting, k, unaccepted_weight=1.0):
    out = peagle_loss(drafter, head, batch, weighting, k=k, unaccepted_weight=unaccepted_weight)
    out.loss.backward()
    return out, grads(drafter)


@pytest.mark.parametrize("segments", [2, 3, 4])
@pytest.mark.parametrize("weighting", ["uniform", "per_depth_mean", Depth0Share(0.5)])
def test_partitioned_gradients_equal_single_pass(segments, weighting):
    spec, k = tiny_spec(), 5
    drafter, head = make_models(spec, seed=segments)
    g = torch.Generator().manual_seed(10 + segments)
    # two rows: a packed pair of documents and one longer document (random COD each)
    examples = [
        build_peagle_example([random_sample(spec, 40, 2, 9), random_sample(spec, 33, 3, 5)], spec, k, 0.8, 0.2, 96, g),
        build_peagle_example(random_sample(spec, 90, 4, 20), spec, k, 0.7, 0.2, 96, g),
    ]
    mask = PrecomputedMask(96, k)
    batch = collate(examples, mask)
    ref_out, ref = reference_grads(drafter, head, batch, weighting, k)

    out = partitioned_loss_backward(drafter, head, examples, segments, weighting, mask=mask, k=k)
    from_examples = grads(drafter)
    assert max_rel_error(from_examples, ref) < 1e-5
    assert out.num_supervised == ref_out.num_supervised
    assert abs(out.loss.item() - ref_out.loss.item()) < 1e-5 * abs(ref_out.loss.item())
    assert out.metrics.keys() == ref_out.metrics.keys()

    partitioned_loss_backward(drafter, head, batch, segments, weighting, k=k)
    assert max_rel_error(grads(drafter), ref) < 1e-5


@pytest.mark.parametrize("segments", [2, 3, 5])
def test_partitioned_gradients_equal_single_pass_where_a_miss_ends_the_chain(segments):
    """``train.recipe.unaccepted_weight`` reads whether an anchor's shallower drafts were right: each
    anchor's chain is charged in one segment, so the segments still sum to the single pass."""
    spec, k = tiny_spec(draft_vocab=2), 5  # two draft tokens: about half the drafts miss
    drafter, head = make_models(spec, seed=segments)
    g = torch.Generator().manual_seed(20 + segments)
    examples = [build_peagle_example(random_sample(spec, n, n, 6), spec, k, 0.8, 0.2, 96, g) for n in (90, 61)]
    mask = PrecomputedMask(96, k)
    batch = collate(examples, mask)
    for weight in (0.0, 0.3):
        ref_out, ref = reference_grads(drafter, head, batch, Depth0Share(0.5), k, unaccepted_weight=weight)
        out = partitioned_loss_backward(drafter, head, examples, segments, Depth0Share(0.5), mask=mask, k=k,
                                        unaccepted_weight=weight)
        assert max_rel_error(grads(drafter), ref) < 1e-5
        assert abs(out.loss.item() - ref_out.loss.item()) < 1e-5 * abs(ref_out.loss.item())
    _, plain = reference_grads(drafter, head, batch, Depth0Share(0.5), k)
    assert max_rel_error(plain, ref) > 1e-2  # the weight changed the gradient: misses happened


def test_partition_batch_matches_trainer_contract():
    """A collated batch split with partition_batch(batch, S), each loss divided by the whole batch's
    count, trains as the batch does."""
    spec, k = tiny_spec(), 4
    drafter, head = make_models(spec, seed=7)
    g = torch.Generator().manual_seed(0)
    examples = [build_peagle_example(random_sample(spec, n, n), spec, k, 0.8, 0.2, 64, g) for n in (50, 64)]
    batch = collate(examples, PrecomputedMask(64, k))
    _, ref = reference_grads(drafter, head, batch, "uniform", k)
    parts = partition_batch(batch, 4)
    assert len(parts) == 4
    assert sum(p.num_supervised for p in parts) == batch.num_supervised
    for part in parts:
        peagle_loss(drafter, head, part, "uniform", batch.num_supervised, k=k).loss.backward()
    assert max_rel_error(grads(drafter), ref) < 1e-5


def test_more_segments_than_anchors_still_exact():
    spec, k = tiny_spec(), 3
    drafter, head = make_models(spec, seed=1)
    example = build_peagle_example(random_sample(spec, 6, 5, 1), spec, k, 1.0, 1.0, 8)
    _, ref = reference_grads(drafter, head, collate([example], PrecomputedMask(8, k)), "uniform", k)
    partitioned_loss_backward(drafter, head, example, 8, k=k)
    assert max_rel_error(grads(drafter), ref) < 1e-5


# ----------------------------------------------------------------------------- flex attention


def packed_and_single(spec: HeadSpec, k: int, seed: int):
    """Two rows of COD-sampled elements: a packed pair of documents, and one longer document."""
    g = torch.Generator().manual_seed(seed)
    return [
        build_peagle_example([random_sample(spec, 40, seed, 9), random_sample(spec, 33, seed + 1, 5)], spec, k, 0.8,
                             0.2, 96, g),
        build_peagle_example(random_sample(spec, 90, seed + 2, 20), spec, k, 0.7, 0.2, 96, g),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("segments", [2, 3])
def test_segments_under_flex_attention_compute_what_the_whole_batch_does(segments):
    """Each segment's block mask is built from its own elements, yet every element it owns gets
    the logits it gets in the whole batch (CPU: flex attention runs forward only; its gradients
    are checked on CUDA below)."""
    spec, k = tiny_spec(), 5
    drafter, _ = make_models(spec, seed=segments)
    drafter.attention = "flex"
    examples, mask = packed_and_single(spec, k, seed=segments), PrecomputedMask(96, k)

    def logits(batch):
        with torch.no_grad():
            return drafter(batch.input_ids, batch.aux_hidden, batch.position_ids, batch.attention, batch.is_mask).logits

    whole = logits(collate(examples, mask))
    per_example = [partition_example(e, segments) for e in examples]
    for s in range(segments):
        parts = [segs[s] for segs in per_example]
        got = logits(collate([p.example for p in parts], mask))
        for row, part in enumerate(parts):
            want = whole[row, part.index[part.owned]]
            error = (got[row, : len(part.index)][part.owned] - want).abs().max() / want.abs().max()
            assert error < 1e-5, (s, row, float(error))


@pytest.mark.gpu
@pytest.mark.parametrize("segments", [2, 3])
def test_partitioned_gradients_under_flex_on_cuda_equal_the_single_pass(segments):
    spec, k = tiny_spec(hidden=64), 5  # 16-wide heads: Triton (flex on CUDA) multiplies no narrower
    drafter, head = make_models(spec, seed=segments)
    batch = collate(packed_and_single(spec, k, seed=segments), PrecomputedMask(96, k))
    _, ref = reference_grads(drafter, head, batch, "uniform", k)  # CPU: the dense path
    gpu, gpu_head = copy.deepcopy(drafter).cuda(), copy.deepcopy(head).cuda()
    gpu.attention = "flex"
    partitioned_loss_backward(gpu, gpu_head, batch.to("cuda"), segments, "uniform", k=k)
    assert max_rel_error({n: g.cpu() for n, g in grads(gpu).items()}, ref) < 1e-4  # two devices' summation orders


# ----------------------------------------------------------------------------- long sequences

PEAK_SCRIPT = textwrap.dedent(
    """
    import json, os, resource, sys, threading, time
    import torch
    sys.path.insert(0, {tests!r})
    from test_partition import make_models, random_sample, tiny_spec
    from peagle.objective import build_peagle_example
    from tests.support.partition import partitioned_loss_backward

    n, segments, k = {n}, {segments}, 4
    torch.set_num_threads(2)
    spec = tiny_spec(hidden=64, target_hidden=64, layers=1, vocab=512, draft_vocab=256, heads=1, kv_heads=1)
    drafter, head = make_models(spec)
    example = build_peagle_example(random_sample(spec, n, 0), spec, k, 0.8, 0.2, n, torch.Generator().manual_seed(0))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    page = os.sysconf("SC_PAGE_SIZE")

    def rss():
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * page

    before, peak, done = rss(), [0], threading.Event()

    def sample():  # the step's own peak: ru_maxrss may already be set by imports
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    start = time.perf_counter()
    out = partitioned_loss_backward(drafter, head, example, segments, k=k)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    finite = all(torch.isfinite(p.grad).all() for p in drafter.parameters() if p.grad is not None)
    print(json.dumps(dict(n=n, segments=segments, elements=len(example), seconds=seconds,
                          peak_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                          before_mib=base / 1024, step_peak_mib=(max(peak[0], rss()) - before) / 2**20,
                          loss=float(out.loss), finite=bool(finite))))
    """
)


def peak_memory_run(n: int, segments: int) -> dict:
    """One forward+backward of an n-token example in a fresh process: peak RSS and time."""
    script = PEAK_SCRIPT.format(tests=os.path.dirname(__file__), n=n, segments=segments)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900,
                          cwd=Path(__file__).resolve().parents[2])  # the script imports tests.support
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_16k_token_sequence_trains_in_8_segments_with_less_memory():
    short_single = peak_memory_run(4096, 1)
    short_split = peak_memory_run(4096, 8)
    assert short_split["step_peak_mib"] < short_single["step_peak_mib"]
    long_split = peak_memory_run(16384, 8)
    assert long_split["finite"] and long_split["loss"] > 0
    print(json.dumps([short_single, short_split, long_split], indent=1))
