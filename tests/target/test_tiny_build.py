"""A tiny embedded-target build: it learns, it is cached, and transformers loads it like a hub model."""

import json
import time

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from peagle.config import TargetConfig
from peagle.facts import default_aux_layer_ids
from peagle.target import load_target_config_and_tokenizer, resolve_target
from peagle.testing.embedded import build_embedded_target

from .conftest import TINY_RECIPE

MESSAGES = [{"role": "user", "content": "Complete this Python function:\n```python\ndef add(a, b):\n```"}]


@pytest.fixture(scope="module")
def report(tiny_target):
    return json.loads((tiny_target / "build_report.json").read_text())


def test_build_writes_a_hub_style_directory(tiny_target):
    names = {p.name for p in tiny_target.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "build_report.json"} <= names
    assert not any(p.name.startswith(".") for p in tiny_target.parent.iterdir() if p.is_dir())


def test_training_lowered_the_heldout_loss(report):
    trained, random_init = report["trained"], report["random_init"]
    assert trained["heldout_loss"] < random_init["heldout_loss"] - 0.7
    assert trained["heldout_top1_accuracy"] > random_init["heldout_top1_accuracy"]
    curve = report["train_loss_curve"]
    assert curve[-1][1] < curve[0][1] - 1.0
    assert report["params"] > 0 and report["build_seconds"] > 0
    assert report["recipe"] == TINY_RECIPE.model_dump(mode="json")


def test_cached_build_is_returned_without_rebuilding(tiny_target, in_home):
    mtime = (tiny_target / "build_report.json").stat().st_mtime
    start = time.perf_counter()
    again = build_embedded_target(TINY_RECIPE, progress=False)
    assert again == tiny_target and time.perf_counter() - start < 1.0
    assert (again / "build_report.json").stat().st_mtime == mtime
    assert resolve_target(TargetConfig(model="embedded", embedded=TINY_RECIPE)) == str(tiny_target)


def test_transformers_loads_model_tokenizer_and_generation_config(tiny_target):
    config = AutoConfig.from_pretrained(tiny_target)
    assert config.num_hidden_layers == 8 and config.hidden_size == TINY_RECIPE.hidden_size
    assert default_aux_layer_ids(config.num_hidden_layers) == [2, 4, 5]
    tok = AutoTokenizer.from_pretrained(tiny_target)
    assert config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|end|>")
    assert GenerationConfig.from_pretrained(tiny_target).eos_token_id == tok.eos_token_id
    assert tok.encode("<|mask|>", add_special_tokens=False) == [tok.convert_tokens_to_ids("<|mask|>")]

    model = AutoModelForCausalLM.from_pretrained(tiny_target)
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert tok.decode(prompt["input_ids"][0]).endswith("<|assistant|>\n")
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]
    hidden = model(**prompt, output_hidden_states=True).hidden_states
    assert len(hidden) == 9 and hidden[4].shape[-1] == TINY_RECIPE.hidden_size


def test_chat_round_trip_keeps_mask_token_single(tiny_target):
    tok = AutoTokenizer.from_pretrained(tiny_target)
    convo = MESSAGES + [{"role": "assistant", "content": "```python\ndef add(a, b):\n    return a + b\n```"}]
    out = tok.apply_chat_template(convo, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert tok.decode(ids) == tok.apply_chat_template(convo, tokenize=False)
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == convo[1]["content"] + "<|end|>"
    mask_id = tok.convert_tokens_to_ids("<|mask|>")
    assert mask_id not in ids
    assert tok.encode("x = <|mask|>", add_special_tokens=False).count(mask_id) == 1


def test_load_target_config_and_tokenizer_for_a_local_dir(tiny_target):
    config, tok = load_target_config_and_tokenizer(TargetConfig(model=str(tiny_target)))
    assert config.vocab_size == TINY_RECIPE.vocab_size and tok.eos_token == "<|end|>"


def test_saved_weights_reproduce_the_trained_model(tiny_target, report):
    """The directory holds the trained weights: its held-out loss is the report's, not random."""
    model = AutoModelForCausalLM.from_pretrained(tiny_target)
    tok = AutoTokenizer.from_pretrained(tiny_target)
    text = "def f(x):\n    return x + 1\n\n\ndef g(y):\n    return y * 2\n"
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert loss < report["random_init"]["heldout_loss"] - 1.0


def test_force_rebuilds_in_place_without_leftovers(tmp_path, monkeypatch):
    monkeypatch.setenv("PEAGLE_HOME", str(tmp_path))
    recipe = TINY_RECIPE.model_copy(update={"train_steps": 2, "corpus_max_bytes": 50_000})
    first = build_embedded_target(recipe, progress=False)
    first_report = (first / "build_report.json").read_text()
    second = build_embedded_target(recipe, force=True, progress=False)
    assert second == first and (second / "model.safetensors").is_file()
    assert json.loads((second / "build_report.json").read_text())["recipe"] == json.loads(first_report)["recipe"]
    assert sorted(p.name for p in first.parent.iterdir() if p.is_dir()) == [first.name]
