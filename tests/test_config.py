"""Config validation: every mistake fails at load time with a message naming the key."""

from pathlib import Path

import pytest
import yaml
from transformers import LlamaConfig

from peagle.config import ConfigError, load_config, parse_config
from peagle.facts import default_aux_layer_ids, head_spec_for, target_facts_from_target

REPO = Path(__file__).resolve().parent.parent
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def demo_dict() -> dict:
    return yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_configs_validate(path):
    cfg = load_config(path)
    assert cfg.name
    assert cfg.eval.ks == sorted(cfg.eval.ks)


def test_real_target_configs_are_shipped():
    names = {p.stem for p in CONFIGS}
    assert {"demo", "llama-3.1-8b-instruct", "qwen3-8b", "gpt-oss-20b"} <= names


def _error(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, "x.yaml")
    return str(info.value)


def test_unknown_key_names_the_key():
    data = demo_dict()
    data["train"]["epocs"] = 3
    msg = _error(data)
    assert "train.epocs" in msg and "unknown key" in msg


def test_unknown_top_level_section():
    data = demo_dict()
    data["trian"] = {}
    assert "trian" in _error(data)


def test_wrong_type_names_the_key():
    data = demo_dict()
    data["train"]["learning_rate"] = "fast"
    assert "train.learning_rate" in _error(data)


def test_k_below_one_is_refused():
    data = demo_dict()
    data["eval"]["ks"] = [0, 3]
    assert "eval.ks" in _error(data)
    data = demo_dict()
    data["train"]["k_train"] = 0
    assert "train.k_train" in _error(data)


def test_train_length_beyond_data_length_is_refused():
    data = demo_dict()
    data["train"]["max_len"] = data["data"]["max_seq_len"] + 1
    assert "train.max_len" in _error(data)


def test_aux_layer_ids_must_be_ascending_triplet():
    data = demo_dict()
    data["data"]["aux_layer_ids"] = [4, 2, 5]
    assert "data.aux_layer_ids" in _error(data)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_overrides_apply_and_are_validated():
    cfg = load_config(REPO / "configs" / "demo.yaml", {"train.epochs": 5})
    assert cfg.train.epochs == 5
    with pytest.raises(ConfigError, match="train.epochs"):
        load_config(REPO / "configs" / "demo.yaml", {"train.epochs": 0})


class _Tok:
    unk_token_id = None

    def __init__(self, vocab):
        self.vocab = vocab

    def convert_tokens_to_ids(self, token):
        return self.vocab.get(token)


def _target(num_layers=8):
    return LlamaConfig(vocab_size=100, hidden_size=64, num_hidden_layers=num_layers,
                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                       max_position_embeddings=2048)


def test_layer_ids_beyond_target_depth_are_refused():
    data = demo_dict()
    data["data"]["aux_layer_ids"] = [2, 4, 9]
    cfg = parse_config(data)
    with pytest.raises(ConfigError, match="beyond the target's depth"):
        target_facts_from_target(cfg, _target(8), _Tok({"<|mask|>": 7}))


def test_unknown_mask_token_is_refused():
    cfg = parse_config(demo_dict())
    with pytest.raises(ConfigError, match="target.mask_token"):
        target_facts_from_target(cfg, _target(8), _Tok({}))


def test_head_spec_defaults_follow_vllm():
    cfg = parse_config(demo_dict())
    spec = head_spec_for(cfg, target_facts_from_target(cfg, _target(8), _Tok({"<|mask|>": 7})))
    assert spec.aux_layer_ids == [2, 4, 5] == default_aux_layer_ids(8)
    assert spec.stored_layer_ids == [2, 4, 5, 8]
    assert spec.mask_token_id == 7
    assert spec.hidden_size == 64 and spec.target_hidden_size == 64
    with pytest.raises(ConfigError):
        default_aux_layer_ids(5)
