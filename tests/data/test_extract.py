"""Hidden states extracted through vLLM equal transformers' (fp32, tiny random Llama)."""

import os
import time

import pytest
import torch

from peagle.config import VllmConfig
from peagle.data.extract import check_layer_ids, extract_hidden_states
from tests.cores import needs_cores

NUM_LAYERS = 4
LAYER_IDS = [0, 1, 2, NUM_LAYERS]  # embeddings, aux layers, and the last layer (pre-norm)
CFG = VllmConfig(max_model_len=256, max_num_seqs=16, cpu_kvcache_space_gib=1)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from peagle.testing.tiny import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), num_layers=NUM_LAYERS))


def make_sequences():
    g = torch.Generator().manual_seed(0)
    seqs = [(f"s{i}", torch.randint(5, 384, (n,), generator=g).tolist()) for i, n in enumerate([1, 7, 33, 150, 200] * 6)]
    shared = seqs[4][1][:120]
    seqs.append(("prefix_a", shared + [9, 10, 11]))  # shares cached prefix blocks with s4
    seqs.append(("prefix_b", shared + [12]))
    seqs.append(("repeat", list(seqs[3][1])))  # fully cached prompt
    return seqs


@pytest.fixture(scope="module")
def extraction(tiny_model, tmp_path_factory):
    """One engine: all good sequences, then a too-long one that must stop the stream."""
    work = tmp_path_factory.mktemp("extract_work")
    seqs = make_sequences()
    too_long = ("too_long", [5] * CFG.max_model_len)
    got, error, first = {}, None, None
    stream = extract_hidden_states(
        tiny_model, CFG, seqs + [too_long], LAYER_IDS, work, dtype="float32", batch_size=8, progress=False
    )
    try:
        for sample_id, hidden in stream:
            got[sample_id] = hidden
            if first is None:  # time from the first result on: engine start-up excluded
                first, first_batch = time.perf_counter(), len(got) + 7
            elif len(got) == len(seqs):
                seconds = time.perf_counter() - first
    except ValueError as err:
        error = err
    tokens = sum(len(s) for _, s in seqs[first_batch:]) if len(got) == len(seqs) else 0
    print(f"extraction: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.0f} tokens/s (tiny model, CPU)")
    return {"seqs": seqs, "got": got, "error": error, "work": work}


def hf_states(model, ids):
    """transformers' hidden_states and the input of the final norm (the pre-norm last layer)."""
    captured = {}

    def keep_input(module, inputs, output):  # returns None: the output is left untouched
        captured["pre"] = inputs[0]

    hook = model.model.norm.register_forward_hook(keep_input)
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    hook.remove()
    return [h[0] for h in out.hidden_states], captured["pre"][0]


def test_layer_ids_are_checked():
    assert check_layer_ids([2, 3, 4], 4) == [2, 3, 4]
    with pytest.raises(ValueError, match="ascending"):
        check_layer_ids([3, 2], 4)
    with pytest.raises(ValueError, match=r"\[0, 4\]"):
        check_layer_ids([2, 5], 4)
    with pytest.raises(ValueError, match="empty"):
        check_layer_ids([], 4)


def test_bad_layer_ids_fail_before_an_engine_starts(tiny_model, tmp_path):
    started = time.perf_counter()
    with pytest.raises(ValueError, match="must lie in"):
        next(extract_hidden_states(tiny_model, CFG, [("a", [1, 2])], [1, 9], tmp_path, progress=False))
    assert time.perf_counter() - started < 20


@pytest.mark.slow
def test_states_equal_transformers_including_final_layer_pre_norm(extraction, tiny_model):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    seqs, got = extraction["seqs"], extraction["got"]
    assert list(got) == [sid for sid, _ in seqs]  # every sequence, in input order
    worst = 0.0
    for sample_id, ids in seqs:
        hidden = got[sample_id]
        assert hidden.shape == (len(ids), len(LAYER_IDS), 128) and hidden.dtype == torch.float32
        hf_hidden, pre_norm = hf_states(hf, ids)
        for j, k in enumerate(LAYER_IDS[:-1]):
            worst = max(worst, (hidden[:, j] - hf_hidden[k]).abs().max().item())
        worst = max(worst, (hidden[:, -1] - pre_norm).abs().max().item())
        # transformers 5.19's last hidden_states entry is AFTER the final norm: not what vLLM captures.
        assert torch.allclose(hf_hidden[NUM_LAYERS], hf.model.norm(pre_norm), atol=1e-5)
        assert not torch.allclose(hidden[:, -1], hf_hidden[NUM_LAYERS], atol=1e-2)
    print(f"max |vLLM - transformers| over all layers: {worst:.2e}")
    assert worst < 1e-4


@pytest.mark.slow
def test_too_long_sequence_is_a_clear_error_and_no_files_remain(extraction):
    err = extraction["error"]
    assert err is not None and "too_long" in str(err) and "max_model_len" in str(err)
    leftovers = [p for _, _, files in os.walk(extraction["work"]) for p in files]
    assert leftovers == []  # per-request files deleted once read; the scratch dir removed at the end


@pytest.mark.slow
@needs_cores(2)
def test_data_parallel_replicas_give_the_same_states(extraction, tiny_model, tmp_path):
    """Two engine replicas in their own processes (one CPU core each here)."""
    seqs = extraction["seqs"][:12]
    dp_cfg = CFG.model_copy(update={"data_parallel_size": 2})
    got = dict(extract_hidden_states(tiny_model, dp_cfg, seqs, LAYER_IDS, tmp_path, dtype="float32",
                                     batch_size=3, progress=False))
    assert sorted(got) == sorted(sid for sid, _ in seqs)
    for sample_id, _ in seqs:
        torch.testing.assert_close(got[sample_id], extraction["got"][sample_id], atol=1e-5, rtol=0)
    assert os.listdir(tmp_path) == []
