"""The drafter: vLLM's weight names, vLLM's computation, training forward == serving."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from peagle.facts import HeadSpec
from peagle.model import PEagleDrafter, TargetWeightsError, load_target_tensors
from peagle.objective import PrecomputedMask, build_peagle_example, collate

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def tiny_spec(hidden=32, target_hidden=32, layers=2, vocab=96, draft_vocab=48, rope_scaling=None) -> HeadSpec:
    return HeadSpec(
        target="tiny",
        target_revision=None,
        target_num_layers=6,
        target_hidden_size=target_hidden,
        vocab_size=vocab,
        aux_layer_ids=[2, 3, 3 + 1],
        final_layer_id=6,
        mask_token_id=vocab - 1,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=hidden // 4,
        intermediate_size=2 * hidden,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=rope_scaling,
        max_position_embeddings=256,
        draft_vocab_size=draft_vocab,
    )


def randomize(drafter: PEagleDrafter, seed: int = 0) -> PEagleDrafter:
    """Non-trivial norms too, so a swapped norm cannot hide."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return drafter.eval()


def random_sample(n: int, ht: int, vocab: int, seed: int = 0, loss_from: int = 0):
    g = torch.Generator().manual_seed(seed)
    return SimpleNamespace(
        token_ids=torch.randint(0, vocab - 1, (n,), generator=g),
        loss_mask=torch.arange(n) >= loss_from,
        hidden=torch.randn(n, 4, ht, generator=g),
    )


# -- an independent reference of vLLM's Eagle3 Llama head, one plain causal sequence ---------


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_forward(drafter: PEagleDrafter, input_ids, fc_hidden, positions):
    """What vLLM computes for one request: causal attention over consecutive slots."""
    spec, sd, eps = drafter.spec, drafter.state_dict(), drafter.spec.rms_norm_eps
    scaling = dict(spec.rope_scaling or {"rope_type": "default"})
    rope = LlamaRotaryEmbedding(
        LlamaConfig(
            hidden_size=spec.hidden_size,
            num_attention_heads=spec.num_heads,
            head_dim=spec.head_dim,
            max_position_embeddings=spec.max_position_embeddings,
            rope_parameters={**scaling, "rope_theta": spec.rope_theta},
        )
    )
    n, nh, nkv, hd = input_ids.numel(), spec.num_heads, spec.num_kv_heads, spec.head_dim
    cos, sin = rope(fc_hidden[None], positions[None])
    residual = fc_hidden
    act = torch.cat(
        [rms(sd["embed_tokens.weight"][input_ids], sd["layers.0.input_layernorm.weight"], eps),
         rms(fc_hidden, sd["layers.0.hidden_norm.weight"], eps)],
        dim=-1,
    )
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        if i > 0:
            residual = act + residual
            act = rms(residual, sd[p + "input_layernorm.weight"], eps)
        q = (act @ sd[p + "self_attn.q_proj.weight"].T).view(n, nh, hd).transpose(0, 1)[None]
        k = (act @ sd[p + "self_attn.k_proj.weight"].T).view(n, nkv, hd).transpose(0, 1)[None]
        v = (act @ sd[p + "self_attn.v_proj.weight"].T).view(n, nkv, hd).transpose(0, 1)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        q, k = q[0], k[0].repeat_interleave(nh // nkv, 0)
        v = v.repeat_interleave(nh // nkv, 0)
        out = torch.empty(nh, n, hd)
        for t in range(n):  # slot t sees slots 0..t
            weights = torch.softmax(q[:, t : t + 1] @ k[:, : t + 1].transpose(1, 2) / hd**0.5, dim=-1)
            out[:, t] = (weights @ v[:, : t + 1])[:, 0]
        attn = out.transpose(0, 1).reshape(n, nh * hd) @ sd[p + "self_attn.o_proj.weight"].T
        residual = attn + residual
        act = rms(residual, sd[p + "post_attention_layernorm.weight"], eps)
        gate, up = act @ sd[p + "mlp.gate_proj.weight"].T, act @ sd[p + "mlp.up_proj.weight"].T
        act = (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    prenorm = act + residual
    return rms(prenorm, sd["norm.weight"], eps) @ sd["lm_head.weight"].T, prenorm


def serving_slots(drafter: PEagleDrafter, sample, anchor: int, k: int):
    """vLLM's parallel-drafting input after anchor p: shifted context + next token + K-1 masks."""
    spec = drafter.spec
    aux = sample.hidden[: anchor + 1, :3].reshape(anchor + 1, -1)
    fc = drafter.state_dict()["fc.weight"]
    mask_feature = drafter.state_dict()["mask_hidden"].view(-1) @ fc.T  # combine_hidden_states(mask_hidden)
    input_ids = torch.cat([sample.token_ids[1 : anchor + 2], torch.full((k - 1,), spec.mask_token_id)])
    fc_hidden = torch.cat([aux @ fc.T, mask_feature.expand(k - 1, -1)])
    return input_ids, fc_hidden, torch.arange(anchor + k)


def training_forward(drafter, example, k):
    batch = collate([example], PrecomputedMask(64, k))
    with torch.no_grad():
        return drafter(batch.input_ids, batch.aux_hidden, batch.position_ids, batch.attention_mask, batch.is_mask)


# -- names and shapes ---------------------------------------------------------------------------


def expected_shapes(spec: HeadSpec) -> dict[str, tuple]:
    h, ht, nq, nkv = spec.hidden_size, spec.target_hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    shapes = {
        "embed_tokens.weight": (spec.vocab_size, h),
        "fc.weight": (h, 3 * ht),
        "norm.weight": (h,),
        "lm_head.weight": (spec.draft_vocab_size, h),
        "mask_hidden": (1, 1, 3 * ht),
        "layers.0.hidden_norm.weight": (h,),
    }
    for i in range(spec.num_layers):
        width = 2 * h if i == 0 else h
        shapes |= {
            f"layers.{i}.self_attn.q_proj.weight": (nq, width),
            f"layers.{i}.self_attn.k_proj.weight": (nkv, width),
            f"layers.{i}.self_attn.v_proj.weight": (nkv, width),
            f"layers.{i}.self_attn.o_proj.weight": (h, nq),
            f"layers.{i}.input_layernorm.weight": (h,),
            f"layers.{i}.post_attention_layernorm.weight": (h,),
            f"layers.{i}.mlp.gate_proj.weight": (spec.intermediate_size, h),
            f"layers.{i}.mlp.up_proj.weight": (spec.intermediate_size, h),
            f"layers.{i}.mlp.down_proj.weight": (h, spec.intermediate_size),
        }
    return shapes


@pytest.mark.parametrize("hidden,target_hidden", [(32, 32), (48, 32)])
def test_state_dict_has_exactly_the_head_names_and_shapes(hidden, target_hidden):
    spec = tiny_spec(hidden=hidden, target_hidden=target_hidden, layers=3)
    state = PEagleDrafter(spec).state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == expected_shapes(spec)
    assert not any(re.match(r"^model\.|rotary|inv_freq", k) for k in state)


def test_unset_draft_vocab_is_a_clear_error():
    spec = tiny_spec()
    spec = HeadSpec(**{**spec.__dict__, "draft_vocab_size": None})
    with pytest.raises(ValueError, match="draft_vocab_size"):
        PEagleDrafter(spec)


# -- training forward == serving ------------------------------------------------------------


@pytest.mark.parametrize("rope_scaling", [None, LLAMA3_SCALING])
def test_training_forward_equals_vllm_step_by_step_drafting(rope_scaling):
    """Element (p, d) of one training pass == draft slot d of vLLM drafting after anchor p."""
    k = 5
    drafter = randomize(PEagleDrafter(tiny_spec(rope_scaling=rope_scaling)))
    sample = random_sample(40, 32, 96, seed=1)
    example = build_peagle_example(sample, drafter.spec, k, 0.8, 0.2, 64, torch.Generator().manual_seed(0))
    out = training_forward(drafter, example, k)
    deepest = example.anchor[example.depth == k - 1]
    assert len(deepest) >= 5
    for anchor in [int(a) for a in deepest[:: max(1, len(deepest) // 4)]]:
        ref_logits, ref_prenorm = reference_forward(drafter, *serving_slots(drafter, sample, anchor, k))
        for d in range(k):
            i = int(((example.anchor == anchor) & (example.depth == d)).nonzero())
            torch.testing.assert_close(out.logits[0, i], ref_logits[anchor + d], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out.hidden[0, i], ref_prenorm[anchor + d], rtol=1e-5, atol=1e-5)


def test_truncating_depths_changes_nothing_for_shallower_depths():
    k = 6
    drafter = randomize(PEagleDrafter(tiny_spec()))
    sample = random_sample(30, 32, 96, seed=2)
    example = build_peagle_example(sample, drafter.spec, k, 0.9, 0.3, 64, torch.Generator().manual_seed(3))
    full = training_forward(drafter, example, k)
    for keep in (1, 3):
        index = (example.depth < keep).nonzero().squeeze(1)
        short = training_forward(drafter, example.select(index), k)
        torch.testing.assert_close(short.logits[0], full.logits[0, index], rtol=1e-5, atol=1e-6)


def test_later_slot_inputs_cannot_reach_earlier_slots():
    k = 4
    drafter = randomize(PEagleDrafter(tiny_spec()))
    example = build_peagle_example(random_sample(24, 32, 96, seed=4), drafter.spec, k, 1.0, 1.0, 64)
    batch = collate([example], PrecomputedMask(64, k))
    # gradient of depth-1 outputs of anchor 5 w.r.t. every element's features
    aux = batch.aux_hidden.clone().requires_grad_(True)
    out = drafter(batch.input_ids, aux, batch.position_ids, batch.attention_mask, batch.is_mask)
    target = ((example.anchor == 5) & (example.depth == 0)).nonzero().item()
    out.logits[0, target].sum().backward()
    touched = aux.grad[0].abs().sum(-1) > 0
    allowed = (example.depth == 0) & (example.anchor <= 5)
    assert touched.any() and not (touched & ~allowed).any()


def test_packed_documents_equal_separate_documents():
    k = 4
    drafter = randomize(PEagleDrafter(tiny_spec()))
    a, b = random_sample(20, 32, 96, seed=5), random_sample(25, 32, 96, seed=6)
    packed = build_peagle_example([a, b], drafter.spec, k, 1.0, 1.0, 64)
    alone = build_peagle_example(b, drafter.spec, k, 1.0, 1.0, 64)
    out_packed = training_forward(drafter, packed, k)
    out_alone = training_forward(drafter, alone, k)
    in_b = packed.doc == 1
    torch.testing.assert_close(out_packed.logits[0, in_b], out_alone.logits[0], rtol=1e-5, atol=1e-5)


def test_hidden_override_replaces_the_projected_feature():
    """EAGLE-3 training-time test: the previous step's prenorm hidden replaces fc(aux)."""
    drafter = randomize(PEagleDrafter(tiny_spec()))
    n = 7
    ids = torch.randint(0, 90, (1, n))
    aux = torch.randn(1, n, 96)
    override = torch.randn(1, n, 32)
    use = torch.tensor([[False, False, True, False, True, True, False]])
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None]
    with torch.no_grad():
        out = drafter(ids, aux, torch.arange(n)[None], causal, hidden_override=override, override_mask=use)
        fc_hidden = torch.where(use[0, :, None], override[0], aux[0] @ drafter.fc.weight.T)
    ref_logits, _ = reference_forward(drafter, ids[0], fc_hidden, torch.arange(n))
    torch.testing.assert_close(out.logits[0], ref_logits, rtol=1e-5, atol=1e-5)


def test_padding_rows_stay_finite_and_logits_mask_selects_rows():
    drafter = randomize(PEagleDrafter(tiny_spec()))
    ex1 = build_peagle_example(random_sample(12, 32, 96, seed=7), drafter.spec, 3, 1.0, 1.0, 64)
    ex2 = build_peagle_example(random_sample(30, 32, 96, seed=8), drafter.spec, 3, 1.0, 1.0, 64)
    batch = collate([ex1, ex2], PrecomputedMask(64, 3))
    with torch.no_grad():
        full = drafter(batch.input_ids, batch.aux_hidden, batch.position_ids, batch.attention_mask, batch.is_mask)
        picked = drafter(
            batch.input_ids, batch.aux_hidden, batch.position_ids, batch.attention_mask, batch.is_mask,
            logits_mask=batch.supervised,
        )
    assert torch.isfinite(full.logits).all()
    torch.testing.assert_close(picked.logits, full.logits[batch.supervised])
    alone = training_forward(drafter, ex1, 3)
    torch.testing.assert_close(full.logits[0, : len(ex1)], alone.logits[0], rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_named():
    drafter = PEagleDrafter(tiny_spec())
    ids = torch.zeros(1, 4, dtype=torch.long)
    mask = torch.ones(1, 4, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="aux_hidden"):
        drafter(ids, torch.zeros(1, 4, 32), torch.arange(4)[None], mask)
    with pytest.raises(ValueError, match="attention_mask"):
        drafter(ids, torch.zeros(1, 4, 96), torch.arange(4)[None], mask.float())


# -- target initialisation, persistence ---------------------------------------------------------


def save_tiny_target(path, tie: bool, sharded: bool, vocab=96, hidden=32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie, max_position_embeddings=256,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.copy_(1 + 0.2 * torch.randn(hidden))
    model.save_pretrained(path, max_shard_size="20KB" if sharded else "1GB")
    return model


@pytest.mark.parametrize("tie,sharded", [(False, False), (True, False), (False, True)])
def test_from_target_copies_embeddings_norm_and_draft_rows(tmp_path, tie, sharded):
    model = save_tiny_target(tmp_path, tie, sharded)
    assert (tmp_path / "model.safetensors.index.json").is_file() == sharded
    spec = tiny_spec()
    draft_ids = torch.sort(torch.randperm(95, generator=torch.Generator().manual_seed(0))[:48]).values
    drafter = PEagleDrafter.from_target(spec, str(tmp_path), draft_ids)
    target_embed = model.model.embed_tokens.weight
    keep = torch.ones(spec.vocab_size, dtype=torch.bool)
    keep[spec.mask_token_id] = False
    torch.testing.assert_close(drafter.embed_tokens.weight[keep], target_embed[keep])
    assert not torch.equal(drafter.embed_tokens.weight[spec.mask_token_id], target_embed[spec.mask_token_id])
    torch.testing.assert_close(drafter.lm_head.weight, model.lm_head.weight[draft_ids])
    torch.testing.assert_close(drafter.norm.weight, model.model.norm.weight)  # not the default ones
    assert drafter.embed_tokens.weight.requires_grad and drafter.mask_hidden.requires_grad
    assert 0 < drafter.mask_hidden.std() < 0.1


def test_from_target_with_other_width_starts_random(tmp_path):
    save_tiny_target(tmp_path, tie=False, sharded=False)
    spec = tiny_spec(hidden=48)
    drafter = PEagleDrafter.from_target(spec, str(tmp_path), torch.arange(48))
    assert drafter.embed_tokens.weight.shape == (96, 48) and drafter.fc.weight.shape == (48, 96)


def test_from_target_rejects_a_draft_vocab_of_another_target(tmp_path):
    save_tiny_target(tmp_path, tie=False, sharded=False)
    with pytest.raises(TargetWeightsError, match="draft_ids"):
        load_target_tensors(tmp_path, torch.tensor([0, 500]))
    with pytest.raises(TargetWeightsError, match="config.json"):
        load_target_tensors(tmp_path / "missing")


def test_mask_row_only_trains_one_row_and_keeps_the_head_format(tmp_path):
    drafter = randomize(PEagleDrafter(tiny_spec()))
    mask_id = drafter.spec.mask_token_id
    before = drafter.state_dict()
    ids = torch.tensor([[3, mask_id, 7]])
    mask = torch.ones(1, 3, 3, dtype=torch.bool).tril()
    args = (ids, torch.randn(1, 3, 96), torch.arange(3)[None], mask)
    logits = drafter(*args).logits

    drafter.train_mask_row_only()
    # the optimizer sees H values of the table, not V x H; the forward is unchanged
    trainable = {n for n, p in drafter.named_parameters() if p.requires_grad}
    assert "embed_tokens.weight" not in trainable and "mask_embedding" in trainable
    assert torch.equal(drafter(*args).logits, logits)
    drafter(*args).logits.sum().backward()
    assert drafter.mask_embedding.grad.abs().sum() > 0 and drafter.embed_tokens.weight.grad is None

    with torch.no_grad():
        drafter.mask_embedding.add_(1.0)  # what a step does to the row
    state = drafter.state_dict()
    assert sorted(state) == sorted(before)  # the head's names only
    others = torch.arange(state["embed_tokens.weight"].shape[0]) != mask_id
    assert torch.equal(state["embed_tokens.weight"][mask_id], before["embed_tokens.weight"][mask_id] + 1.0)
    assert torch.equal(state["embed_tokens.weight"][others], before["embed_tokens.weight"][others])
    # ... in a copy: the frozen table stays as every data-parallel replica holds it
    assert not torch.equal(drafter.embed_tokens.weight[mask_id], state["embed_tokens.weight"][mask_id])

    # a state dict in the head's format (a checkpoint, a head) restores the row, and the plain
    # drafter it is loaded into computes the same
    drafter.save(tmp_path / "d.safetensors")
    plain = PEagleDrafter.load(tmp_path / "d.safetensors", drafter.spec)
    assert torch.equal(plain(*args).logits, drafter(*args).logits)
    again = randomize(PEagleDrafter(tiny_spec()))
    again.train_mask_row_only()
    again.load_state_dict(state)
    assert torch.equal(again.mask_embedding, drafter.mask_embedding)


def test_save_load_roundtrip(tmp_path):
    spec = tiny_spec()
    drafter = randomize(PEagleDrafter(spec))
    drafter.save(tmp_path / "drafter.safetensors")
    assert not list(tmp_path.glob("*.tmp"))
    loaded = PEagleDrafter.load(tmp_path / "drafter.safetensors", spec)
    for name, value in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    with pytest.raises(ValueError, match="does not match"):
        PEagleDrafter.load(tmp_path / "drafter.safetensors", tiny_spec(layers=3))


def test_a_checkpoint_loads_in_the_shape_it_records(tmp_path):
    """``from_checkpoint`` needs nothing but the checkpoint: its head_spec.json gives the shape."""
    deeper = tiny_spec(layers=3)
    drafter = randomize(PEagleDrafter(deeper))
    drafter.save(tmp_path / "drafter.safetensors")
    with pytest.raises(FileNotFoundError, match="head_spec.json not found"):
        PEagleDrafter.from_checkpoint(tmp_path)
    deeper.save(tmp_path / "head_spec.json")
    loaded = PEagleDrafter.from_checkpoint(tmp_path)
    assert loaded.spec == deeper and len(loaded.layers) == 3
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in drafter.state_dict().items())


def test_bf16_cast_keeps_rope_frequencies_in_fp32():
    drafter = PEagleDrafter(tiny_spec()).to(torch.bfloat16)
    assert drafter.rotary.inv_freq.dtype == torch.float32
    assert all(p.dtype == torch.bfloat16 for p in drafter.parameters())


def test_attention_never_lets_torch_pick_cudnn(monkeypatch):
    """cuDNN's attention (PyTorch's pick for bf16 on Hopper) builds a graph per sequence length:
    0.3-0.4 s per call on an H100 when, as in training, every step's length is new. The drafter's
    attention must run with it switched off, and leave torch's setting as it found it."""
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    drafter = randomize(PEagleDrafter(tiny_spec(layers=2)))
    n = 9
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None]
    drafter(torch.randint(0, 90, (1, n)), torch.randn(1, n, 96), torch.arange(n)[None], causal).logits.sum().backward()
    assert seen == [False, False]  # one call per layer, cuDNN off in each
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
