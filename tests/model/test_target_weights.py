"""One tensor of a target, read through its safetensors index: what the head validator compares against."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from peagle.export.validate import read_target
from peagle.model.target_weights import TargetWeightsError, read_target_tensor


def save_target(path, sharded: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(path, max_shard_size="8KB" if sharded else "1GB")
    return model


@pytest.mark.parametrize("sharded", [False, True])
def test_the_validator_reads_the_embedding_in_its_stored_dtype(tmp_path, sharded):
    model = save_target(tmp_path, sharded)
    assert (tmp_path / "model.safetensors.index.json").is_file() == sharded
    embed = read_target_tensor(tmp_path, "embed_tokens.weight")
    assert embed.dtype == torch.bfloat16
    torch.testing.assert_close(embed, model.model.embed_tokens.weight)
    facts = read_target(tmp_path)
    assert (facts.vocab_size, facts.hidden_size, facts.num_layers) == (96, 32, 2)
    torch.testing.assert_close(facts.embed, model.model.embed_tokens.weight)
    assert read_target_tensor(tmp_path, "no_such.weight") is None


def test_a_target_without_safetensors_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TargetWeightsError, match="safetensors"):
        read_target_tensor(tmp_path, "embed_tokens.weight")
