"""The validator rejects every way a head can fail to load right in vLLM, naming the fix."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from peagle.export.validate import HeadValidationError, validate_head


def rewrite_weights(head_dir, edit):
    path = head_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def rewrite_config(head_dir, edit):
    path = head_dir / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def problems_of(head, target, **kwargs) -> str:
    with pytest.raises(HeadValidationError) as err:
        validate_head(head, target, load_in_vllm=False, **kwargs)
    return str(err.value)


def test_a_good_head_passes_every_static_check(head, tiny_target):
    report = validate_head(head, tiny_target, load_in_vllm=False)
    assert report.ok and report.vllm is None
    assert report.checks == ["config", "tensor names, shapes and dtypes", "d2t / t2d", "mask embedding row"]
    assert report.warnings == []


def test_renamed_tensor_is_missing_and_unexpected_with_the_fix(head, tiny_target):
    rewrite_weights(head, lambda t: t.__setitem__("model.fc.weight", t.pop("fc.weight")))
    text = problems_of(head, tiny_target)
    assert "tensor fc.weight is missing" in text
    assert "unexpected tensor model.fc.weight" in text
    assert "drop the 'model.' prefix" in text


def test_midlayer_alias_is_accepted(head, tiny_target):
    def to_midlayer(t):
        for name in [n for n in t if n.startswith("layers.0.")]:
            t["midlayer." + name[len("layers.0.") :]] = t.pop(name)

    rewrite_weights(head, to_midlayer)
    assert validate_head(head, tiny_target, load_in_vllm=False).ok


def test_wrong_shape_is_reported(head, tiny_target):
    rewrite_weights(head, lambda t: t.__setitem__("lm_head.weight", t["lm_head.weight"][:-1].clone()))
    assert "lm_head.weight has shape [127, 128], expected [128, 128]" in problems_of(head, tiny_target)


def test_mixed_float_dtypes_are_reported(head, tiny_target):
    rewrite_weights(head, lambda t: t.__setitem__("norm.weight", t["norm.weight"].half()))
    assert "norm.weight has dtype torch.float16, expected torch.float32" in problems_of(head, tiny_target)


def test_mask_row_equal_to_the_targets_is_an_unlearned_row(head, tiny_target, target_embed, spec):
    def copy_row(t):
        t["embed_tokens.weight"][spec.mask_token_id] = target_embed[spec.mask_token_id]

    rewrite_weights(head, copy_row)
    assert f"the mask token's embed row ({spec.mask_token_id}) equals the target's row" in problems_of(head, tiny_target)


def test_rows_equal_only_in_bfloat16_count_as_equal(head, tiny_target, target_embed, spec):
    """vLLM on CPU serves float32 checkpoints in bfloat16 and compares the tables there."""
    in_bf16 = target_embed[spec.mask_token_id].bfloat16().float()
    below_bf16 = in_bf16 * (1 + 2**-10)  # rounds back to the same bfloat16 values
    assert not torch.equal(below_bf16, target_embed[spec.mask_token_id])
    rewrite_weights(head, lambda t: t["embed_tokens.weight"].__setitem__(spec.mask_token_id, below_bf16))
    assert "equals the target's row" in problems_of(head, tiny_target)


def test_whole_table_equal_to_the_targets_is_reported(head, tiny_target, target_embed):
    rewrite_weights(head, lambda t: t.__setitem__("embed_tokens.weight", target_embed.clone()))
    assert "vLLM will share the target's" in problems_of(head, tiny_target)


def test_target_embedding_can_be_passed_in(head, tiny_target, spec):
    other = torch.zeros(spec.vocab_size, spec.hidden_size)
    assert validate_head(head, tiny_target, load_in_vllm=False, target_embed=other).ok


def test_d2t_holding_target_ids_instead_of_offsets(head, tiny_target, vocab):
    rewrite_weights(head, lambda t: t.__setitem__("d2t", vocab["draft_ids"].clone()))
    assert "d2t holds OFFSETS" in problems_of(head, tiny_target)


def test_d2t_out_of_order_and_t2d_disagreeing(head, tiny_target):
    def swap(t):
        d2t = t["d2t"]
        d2t[10], d2t[11] = d2t[11] + 1, d2t[10] - 1  # targets 10 and 11 swap places
        t["t2d"][0] = True  # and t2d marks one id too many

    rewrite_weights(head, swap)
    text = problems_of(head, tiny_target)
    assert "strictly increasing" in text
    assert "t2d and d2t disagree" in text


def test_d2t_with_a_full_vocabulary_is_rejected(head, tiny_target, spec):
    def full_vocab(t):
        t["lm_head.weight"] = torch.randn(spec.vocab_size, spec.hidden_size)
        t["t2d"] = torch.ones(spec.vocab_size, dtype=torch.bool)

    rewrite_weights(head, full_vocab)
    rewrite_config(head, lambda c: c.__setitem__("draft_vocab_size", spec.vocab_size))
    text = problems_of(head, tiny_target)
    assert "unexpected tensor d2t" in text and "only when draft_vocab_size < vocab_size" in text


def test_config_inconsistencies_are_all_listed(head, tiny_target):
    def break_config(c):
        c["ptd_token_id"] = c["mask_token_id"] + 1
        c["eagle_aux_hidden_state_layer_ids"] = [5, 4, 2]
        c["vocab_size"] += 1
        c["tie_word_embeddings"] = True

    rewrite_config(head, break_config)
    text = problems_of(head, tiny_target)
    assert "mask token ids disagree" in text
    assert "not 3 strictly ascending ids" in text
    assert "differs from the target's" in text
    assert "tie_word_embeddings is not false" in text
    assert text.count("fix:") >= 4


def test_missing_mask_id_and_mask_hidden_for_parallel_drafting(head, tiny_target):
    rewrite_config(head, lambda c: [c.pop("mask_token_id"), c.pop("ptd_token_id")])
    rewrite_weights(head, lambda t: t.pop("mask_hidden"))
    text = problems_of(head, tiny_target)
    assert "no mask token id" in text
    assert "tensor mask_hidden is missing" in text
    # the same head is a valid EAGLE-3 (sequential) head
    assert validate_head(head, tiny_target, load_in_vllm=False, method="eagle3").ok


def test_zero_mask_hidden_is_reported(head, tiny_target):
    rewrite_weights(head, lambda t: t["mask_hidden"].zero_())
    assert "mask_hidden is all zeros" in problems_of(head, tiny_target)


def test_missing_files_are_named(tmp_path, tiny_target):
    (tmp_path / "h").mkdir()
    text = problems_of(tmp_path / "h", tiny_target)
    assert "config.json is missing" in text and "model.safetensors is missing" in text
