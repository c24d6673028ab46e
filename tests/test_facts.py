"""Facts live with what they describe: the target's in the dataset, the drafter's in the checkpoint."""

import json
from pathlib import Path

import pytest
from transformers import LlamaConfig

from peagle.config import ConfigError, load_config
from peagle.facts import HeadSpec, TargetFacts, head_spec_for, load_dataset_facts, target_facts_from_target
from peagle.layout import DataLayout, RunLayout
from peagle.stages import with_method

REPO = Path(__file__).resolve().parent.parent


class _Tok:
    unk_token_id = None

    def convert_tokens_to_ids(self, token):
        return {"<|mask|>": 7}.get(token)


def demo(**overrides):
    return load_config(REPO / "configs" / "tiny.yaml", overrides)


def facts_of_a_target(cfg) -> TargetFacts:
    target = LlamaConfig(vocab_size=100, hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=2048)
    return target_facts_from_target(cfg, target, _Tok()).with_draft_vocab(50)


def test_the_drafter_shape_comes_from_the_drafter_section_not_the_data():
    facts = facts_of_a_target(demo())
    # Changing the drafter section changes neither the target facts nor the data's cache key...
    assert facts_of_a_target(demo(**{"drafter.num_layers": 4})) == facts
    assert demo(**{"drafter.num_layers": 4}).section_hash("target", "data") == demo().section_hash("target", "data")
    # ...but the head trained on them has the new shape.
    two, four = head_spec_for(demo(**{"drafter.num_layers": 2}), facts), head_spec_for(demo(**{"drafter.num_layers": 4}), facts)
    assert (two.num_layers, four.num_layers) == (2, 4)
    assert two.same_target_as(facts) and four.same_target_as(facts)
    assert four.method == "peagle" and four.k_train == demo().train.peagle.k_train
    wide = head_spec_for(demo(**{"drafter.hidden_size": 128}), facts)
    assert (wide.hidden_size, wide.num_heads, wide.head_dim, wide.intermediate_size) == (128, 2, 64, 512)
    with pytest.raises(ConfigError, match="drafter: hidden_size 64 must divide by num_heads 3"):
        head_spec_for(demo(**{"drafter.num_heads": 3}), facts)


def test_an_eagle3_head_may_have_a_depth_of_its_own():
    """train.eagle3.num_layers: the EAGLE-3 baseline at its own best depth beside a deeper P-EAGLE head."""
    cfg = demo(**{"drafter.num_layers": 3, "train.eagle3.num_layers": 2})
    facts = facts_of_a_target(cfg)
    assert head_spec_for(cfg, facts).num_layers == 3  # P-EAGLE: the drafter section's
    assert head_spec_for(with_method(cfg, "eagle3"), facts).num_layers == 2
    unset = demo(**{"drafter.num_layers": 3, "train.eagle3.num_layers": None})
    assert head_spec_for(with_method(unset, "eagle3"), facts).num_layers == 3


def test_facts_and_specs_round_trip(tmp_path):
    cfg = demo()
    facts = facts_of_a_target(cfg)
    data = DataLayout(tmp_path / "data")
    data.root.mkdir()
    facts.save(data.facts)
    assert load_dataset_facts(data) == facts
    spec = head_spec_for(cfg, facts)
    spec.save(tmp_path / "head_spec.json")
    assert HeadSpec.load(tmp_path / "head_spec.json") == spec
    with pytest.raises(FileNotFoundError, match="build the dataset first"):
        load_dataset_facts(DataLayout(tmp_path / "nothing"))


def test_run_layout_names_every_path(tmp_path):
    run = RunLayout(tmp_path)
    assert run.data.manifest("eval") == tmp_path / "data" / "splits" / "eval" / "manifest.json"
    assert run.data.facts == tmp_path / "data" / "target_facts.json"
    assert run.checkpoints("eagle3", "0123456789abcdef") == tmp_path / "checkpoints" / "eagle3" / "0123456789ab"
    assert run.method_checkpoints("eagle3") == tmp_path / "checkpoints" / "eagle3"
    assert run.head("peagle") == tmp_path / "heads" / "peagle"
    assert run.online_results == tmp_path / "eval" / "online_results.json"
    assert run.warm_start(3) == tmp_path / "warm_start" / "v3"
    assert run.revision("abc") == tmp_path / "revisions" / "abc"


def test_a_head_spec_of_another_format_is_refused_with_the_fix(tmp_path):
    cfg = demo()
    spec = head_spec_for(cfg, facts_of_a_target(cfg))
    spec.save(tmp_path / "head_spec.json")
    data = json.loads((tmp_path / "head_spec.json").read_text())
    assert data["version"] == 1 and json.loads(spec.to_json()) == data
    del data["version"]
    (tmp_path / "head_spec.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"head spec version None is not 1: .*train the head again"):
        HeadSpec.load(tmp_path / "head_spec.json")
