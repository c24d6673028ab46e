"""The deployment path end to end, and exact: a head whose every tensor is random is exported,
registered, promoted to ``champion``, downloaded by alias, and ``vllm serve`` (over HTTP,
parallel drafting) drafts with THAT directory exactly what ``peagle.model.PEagleDrafter``
predicts, step by step.

The golden head (test_vllm_roundtrip.py) is blind to q/k/v, gate/up and the layer norms;
here every one of them, fc, mask_hidden, the embedding rows and lm_head decides drafts.

How the drafts are observed: the target is the marker target (it always emits ``TOKEN``),
so vLLM accepts a draft exactly when it is ``TOKEN``, and vLLM's per-request metrics
(``--per-request-spec-decode-metrics detailed``) list, for every verify step, how many
leading drafts were accepted. The head's lm_head row for ``TOKEN`` is ``alpha * w``: a draft
is ``TOKEN`` when ``alpha * w . norm(h)`` beats every other (random) row, one bit per draft
that flips with any wrong weight, norm, name or position. ``w`` is drawn orthogonal to the
final states' dominant directions (what the rows of a prompt, or all mask slots, share) so
the bit varies from draft to draft; ``alpha`` sets how often it is ``TOKEN``. The drafter's
drafts come from ``peagle.eval.offline.draft_tokens``
(the training layout: mask slots at their positions) on the target's hidden states
(transformers, fp32) for the sequence vLLM produces; walking them as greedy speculative
decoding gives the accepted counts vLLM must report, every step of every request.
"""

import json
import os
import sys
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from peagle.config import TrackingConfig
from tests.processes import free_port, process_group, wait_http_ok

pytestmark = pytest.mark.slow
K = 3
DRAFT_VOCAB = 128
TOKEN = 101  # the marker target's constant token (peagle.testing.golden.build_golden_pair)
PROMPT_LENGTHS = (9, 17, 30)
MAX_TOKENS = 40
MIN_LOGIT_GAP = 1e-3  # TOKEN's logit vs the best other one; vLLM's fp32 drafter differs from torch's by ~1e-5
NUM_TOP = 24  # w is orthogonal to this many top directions of the final states (what prompts share)
FIRST_DRAFT_RATE = 0.6  # the share of first drafts that are TOKEN, over every anchor
SERVER_START_S = 600


# ----------------------------------------------------------------------------- the head


def random_head_state(spec, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor random at a scale where it matters (projections keep unit scale, so the
    attention is far from uniform; norms are not all ones)."""
    from peagle.model import PEagleDrafter

    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in PEagleDrafter(spec).state_dict().items():
        if name.endswith("norm.weight"):
            state[name] = 0.5 + torch.rand(tensor.shape, generator=g)
        elif name in ("embed_tokens.weight", "mask_hidden"):
            state[name] = torch.randn(tensor.shape, generator=g)
        else:
            state[name] = torch.randn(tensor.shape, generator=g) / tensor.shape[-1] ** 0.5
    return state


def target_hidden_states(target: Path, sequences: list[torch.Tensor], aux_layer_ids) -> list[SimpleNamespace]:
    """Samples as ``draft_tokens`` reads them: token ids and [n, aux + final, Ht] states (fp32)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    samples = []
    with torch.no_grad():
        for seq in sequences:
            states = model(seq[None], output_hidden_states=True).hidden_states
            hidden = torch.stack([states[i][0] for i in aux_layer_ids] + [states[-1][0]], dim=1)
            samples.append(SimpleNamespace(token_ids=seq, hidden=hidden))
    return samples


def drafts_with_logits(drafter, samples, spec, vocab, prompt_lengths):
    """Per sample: Long [A, K] drafts after every anchor vLLM drafts at, and every logit row computed."""
    from peagle.eval.offline import draft_tokens

    drafts, logits = [], []
    hook = drafter.lm_head.register_forward_hook(lambda module, inputs, out: logits.append(out.detach()))
    try:
        for sample, p in zip(samples, prompt_lengths):
            anchors = torch.arange(p - 1, sample.token_ids.numel() - 1)
            drafts.append(draft_tokens(drafter, sample, spec, vocab, anchors, K))
    finally:
        hook.remove()
    return drafts, torch.cat([x.reshape(-1, x.shape[-1]) for x in logits])


def make_lm_head_decisive(drafter, samples, spec, vocab, prompt_lengths, seed: int, rate: float) -> None:
    """lm_head row TOKEN = alpha * w, w orthogonal to the final states' top directions; alpha
    set so that about ``rate`` of the first drafts are TOKEN."""
    from peagle.eval.offline import draft_tokens

    states = []
    hook = drafter.norm.register_forward_hook(lambda module, inputs, out: states.append(out.detach()))
    try:
        for sample, p in zip(samples, prompt_lengths):
            draft_tokens(drafter, sample, spec, vocab, torch.arange(p - 1, sample.token_ids.numel() - 1), K)
    finally:
        hook.remove()
    rows = torch.cat([s.reshape(-1, s.shape[-1]) for s in states])
    top = torch.linalg.svd(rows, full_matrices=False).Vh[:NUM_TOP]
    w = torch.randn(rows.shape[-1], generator=torch.Generator().manual_seed(seed))
    w = w - top.T @ (top @ w)
    w = w / w.norm()
    row = int((vocab.draft_ids == TOKEN).nonzero()[0, 0])
    lo, hi = 0.0, 100.0
    for _ in range(20):  # bisection: the share of TOKEN grows with alpha
        alpha = (lo + hi) / 2
        with torch.no_grad():
            drafter.lm_head.weight[row] = alpha * w
        drafts, _ = drafts_with_logits(drafter, samples, spec, vocab, prompt_lengths)
        got = torch.cat([d[:, 0] for d in drafts]).eq(TOKEN).float().mean()
        lo, hi = (alpha, hi) if got < rate else (lo, alpha)


def accepted_per_step(drafts: torch.Tensor, max_tokens: int) -> list[int]:
    """Greedy speculative decoding against a target that always emits TOKEN, as vLLM runs it:
    after the prefill token, each step verifies K drafts, keeps the accepted prefix plus one.
    ``drafts[i]``: the drafts after anchor prompt_len - 1 + i."""
    steps, generated = [], 1
    while generated < max_tokens:
        row = drafts[generated - 1]  # anchor prompt_len + generated - 2: the state before the last token
        accepted = int((row == TOKEN).long().cumprod(0).sum())
        steps.append(accepted)
        generated += accepted + 1
    return steps


@pytest.fixture(scope="module")
def random_head(golden_pair, tmp_path_factory):
    """(head dir, the drafter's accepted counts per step for each prompt, the prompts)."""
    from peagle.data.vocab import vocab_from_ids
    from peagle.export.head import export_head
    from peagle.model import PEagleDrafter
    from peagle.testing.golden import draft_vocab_skipping_low_ids, tiny_head_spec

    target, _ = golden_pair
    spec = tiny_head_spec(target, draft_vocab_size=DRAFT_VOCAB)
    vocab = vocab_from_ids(draft_vocab_skipping_low_ids(spec.vocab_size, DRAFT_VOCAB, spec.mask_token_id)["draft_ids"],
                           spec.vocab_size)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(7, spec.vocab_size, (n,), generator=g) for n in PROMPT_LENGTHS]  # no special tokens
    samples = target_hidden_states(target, [torch.cat([p, torch.full((MAX_TOKENS,), TOKEN)]) for p in prompts],
                                   spec.aux_layer_ids)
    drafter = PEagleDrafter(spec)
    drafter.load_state_dict(random_head_state(spec, seed=3))
    drafter.eval()
    make_lm_head_decisive(drafter, samples, spec, vocab, PROMPT_LENGTHS, seed=2, rate=FIRST_DRAFT_RATE)
    drafts, logits = drafts_with_logits(drafter, samples, spec, vocab, PROMPT_LENGTHS)
    row = int((vocab.draft_ids == TOKEN).nonzero()[0, 0])
    others = torch.cat([logits[:, :row], logits[:, row + 1:]], dim=1).max(-1).values
    assert (logits[:, row] - others).abs().min() > MIN_LOGIT_GAP, "a draft is a near tie: pick another seed"
    expected = [accepted_per_step(d, MAX_TOKENS) for d in drafts]
    head = export_head(drafter.state_dict(), spec, vocab, tmp_path_factory.mktemp("export") / "random-head",
                       dtype=torch.float32, target_path=target)
    return head, expected, [p.tolist() for p in prompts]


# ----------------------------------------------------------------------------- the registry round trip


@pytest.fixture(scope="module")
def champion_dir(random_head, golden_pair, tmp_path_factory):
    """Register the head in a tmp SQLite store, promote it, and download the champion."""
    from peagle.publish.gate import promote_if_better
    from peagle.publish.pull import download_champion
    from peagle.publish.registry import CHAMPION, register_head
    from peagle.tracking.mlflow_run import Tracker

    head, _, _ = random_head
    target, _ = golden_pair
    store = tmp_path_factory.mktemp("mlflow")
    tracking = TrackingConfig(tracking_uri=f"sqlite:///{store / 'mlflow.db'}")
    with Tracker(tracking, str(target), run_name="champion-serving") as tracker:
        name = tracker.registered_model_name
        version = register_head(tracker, tracker.run_id, head, name,
                                tags={"method": "p-eagle", "K": str(K)}, metrics={"score": 1.0})
        decision = promote_if_better(tracker, name, version.version, 1.0, margin=0.0, validated=True)
        assert decision.promoted, decision.reason
        assert tracker.client.get_registered_model(name).aliases[CHAMPION] == version.version
        return download_champion(tracker, name, tmp_path_factory.mktemp("deploy") / "champion")


def test_champion_download_is_the_exported_head(random_head, champion_dir):
    head, _, _ = random_head
    assert champion_dir != head
    for name in ("config.json", "model.safetensors"):
        assert (champion_dir / name).read_bytes() == (head / name).read_bytes()
    assert json.loads((champion_dir / "config.json").read_text())["architectures"]


# ----------------------------------------------------------------------------- vllm serve


@contextmanager
def vllm_serve(target: Path, head: Path, log_path: Path):
    """``vllm serve TARGET --speculative-config ...`` as a user runs it; yields the base URL."""
    from peagle.contract import speculative_config

    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target),
           "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "256",
           "--max-num-seqs", "4", "--enforce-eager", "--seed", "0",
           "--speculative-config", json.dumps(speculative_config(str(head), K, parallel_drafting=True)),
           "--per-request-spec-decode-metrics", "detailed"]
    url = f"http://127.0.0.1:{port}"
    with process_group(cmd, log_path, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}) as proc:
        wait_http_ok(f"{url}/health", proc, log_path, SERVER_START_S, what="vllm serve")
        yield url


def complete(url: str, model: str, prompt: list[int]) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def test_vllm_drafts_exactly_what_the_drafter_predicts(random_head, champion_dir, golden_pair, tmp_path):
    _, expected, prompts = random_head
    target, _ = golden_pair
    with vllm_serve(target, champion_dir, tmp_path / "vllm.log") as url:
        replies = [complete(url, str(target), prompt) for prompt in prompts]

    print(f"\naccepted drafts per step, drafter: {expected}")
    for reply, want in zip(replies, expected):
        assert reply["choices"][0]["token_ids"] == [TOKEN] * MAX_TOKENS  # the marker target's greedy output
        spec = reply["metrics"]["speculative_decoding"]
        assert spec["per_step_drafted"] == [K] * len(spec["per_step_accepted"])  # parallel drafting: K per step
        assert spec["per_step_accepted"] == want
    flat = [a for steps in expected for a in steps]
    assert {0, K} <= set(flat) and len(flat) >= 30  # drafts both rejected and accepted in full: the bits vary
