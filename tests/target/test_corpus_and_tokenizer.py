"""Corpus split, chat examples, tokenizer + chat template, recipe hashing and target resolution."""

import json
import platform

import pytest

from peagle.config import ConfigError, EmbeddedTargetRecipe, TargetConfig
from peagle.paths import REPO_ROOT
from peagle.target import embedded as build_mod
from peagle.target import embedded_target_dir, load_target_config_and_tokenizer, recipe_hash, resolve_target
from peagle.testing.embedded.corpus import (
    MAX_ASSISTANT_CHARS,
    MAX_USER_CHARS,
    SPECIAL_TOKENS,
    chat_examples,
    is_heldout,
    list_stdlib_files,
    load_corpus,
    stdlib_root,
)
from peagle.testing.embedded.prompts import GENERATED_WITH_PYTHON, embedded_prompt_messages
from peagle.testing.embedded.tokenizer import render_chat, train_bpe, wrap_tokenizer

MESSAGES = [
    {"role": "user", "content": "Complete this Python function:\n```python\ndef f(x):\n    \"\"\"Twice x.\"\"\"\n```"},
    {"role": "assistant", "content": "```python\ndef f(x):\n    return 2 * x\n```"},
]


@pytest.fixture(scope="module")
def small_corpus():
    return load_corpus(max_bytes=200_000, heldout_fraction=0.1, seed=0)


@pytest.fixture(scope="module")
def tokenizer(small_corpus):
    return wrap_tokenizer(train_bpe((f.text for f in small_corpus.train), 600), 512)


def test_stdlib_listing_is_sorted_and_skips_tests():
    root = stdlib_root()
    files = list_stdlib_files(root)
    rels = [p.relative_to(root).as_posix() for p in files]
    assert rels == sorted(rels) and len(rels) > 100
    assert not any("/test/" in f"/{r}" or "/tests/" in f"/{r}" or "site-packages/" in r for r in rels)


def test_split_is_deterministic_disjoint_and_capped(small_corpus):
    again = load_corpus(max_bytes=200_000, heldout_fraction=0.1, seed=0)
    assert [f.relpath for f in again.train] == [f.relpath for f in small_corpus.train]
    train, held = {f.relpath for f in small_corpus.train}, {f.relpath for f in small_corpus.heldout}
    assert train and held and not train & held
    assert all(is_heldout(r, 0.1, 0) for r in held) and not any(is_heldout(r, 0.1, 0) for r in train)
    stats = small_corpus.stats()
    assert stats["train_bytes"] <= 200_000 and stats["heldout_bytes"] <= 20_000
    other_seed = load_corpus(max_bytes=200_000, heldout_fraction=0.1, seed=1)
    assert [f.relpath for f in other_seed.train] != [f.relpath for f in small_corpus.train]


def test_chat_examples_pair_signature_with_code(small_corpus):
    examples = chat_examples(small_corpus.train)
    assert len(examples) > 20
    for ex in examples:
        user, assistant = (m["content"] for m in ex.messages())
        assert ex.head in user and ex.code.startswith(ex.head)
        assert ex.head.startswith(("def ", "async def "))
        assert len(user) <= MAX_USER_CHARS and len(ex.code) <= MAX_ASSISTANT_CHARS
        assert assistant.startswith("```python\n") and assistant.endswith("\n```")
        assert not any(tok in user + assistant for tok in SPECIAL_TOKENS)


def test_special_tokens_are_single_tokens_with_fixed_ids(tokenizer):
    assert tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS) == [0, 1, 2, 3, 4]
    assert tokenizer.encode("<|mask|>", add_special_tokens=False) == [3]
    assert tokenizer.eos_token == "<|end|>" and tokenizer.pad_token == "<|pad|>"
    assert tokenizer.mask_token_id == 3
    ids = tokenizer.encode("def f(x):\n    return x  # é\n", add_special_tokens=False)
    assert tokenizer.decode(ids) == "def f(x):\n    return x  # é\n"  # byte-level: lossless


def test_chat_template_matches_training_text_and_masks_assistant(tokenizer):
    assert tokenizer.apply_chat_template(MESSAGES, tokenize=False) == render_chat(MESSAGES)
    out = tokenizer.apply_chat_template(MESSAGES, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assistant_ids = [i for i, m in zip(ids, mask) if m]
    assert tokenizer.decode(assistant_ids) == MESSAGES[1]["content"] + "<|end|>"
    assert tokenizer.decode(ids) == render_chat(MESSAGES)
    prompt = tokenizer.apply_chat_template(MESSAGES[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == render_chat(MESSAGES[:1]) + "<|assistant|>\n"
    with pytest.raises(Exception, match="only knows user and assistant"):
        tokenizer.apply_chat_template([{"role": "system", "content": "hi"}], tokenize=False)


def test_recipe_hash_keys_the_cache(monkeypatch, in_home):
    base = EmbeddedTargetRecipe()
    assert recipe_hash(base) == recipe_hash(EmbeddedTargetRecipe())
    assert recipe_hash(base) != recipe_hash(base.model_copy(update={"train_steps": base.train_steps + 1}))
    assert embedded_target_dir(base) == in_home.resolve() / "targets" / f"embedded-{recipe_hash(base)}"
    before = recipe_hash(base)
    monkeypatch.setattr(build_mod, "BUILD_VERSION", build_mod.BUILD_VERSION + "-next")
    assert recipe_hash(base) != before


def test_a_run_never_builds_the_embedded_test_target_and_says_what_does(monkeypatch, tmp_path):
    monkeypatch.setenv("PEAGLE_HOME", str(tmp_path))  # nothing built here
    with pytest.raises(ConfigError, match=r"tiny test target.*`python -m peagle.testing.embedded`.*configs/demo.yaml"):
        resolve_target(TargetConfig(model="embedded"))
    assert not (tmp_path / "targets").exists()


def test_resolve_local_path_and_missing_path(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_target(TargetConfig(model=str(tmp_path))) == str(tmp_path.resolve())
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_target(TargetConfig(model=str(tmp_path / "missing")))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="without a config.json"):
        resolve_target(TargetConfig(model=str(empty)))


def test_a_hub_id_resolves_online_and_offline_only_from_the_cache(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    assert resolve_target(TargetConfig(model="org/some-model")) == "org/some-model"  # the hub is asked when loaded
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match=r"target.model 'org/some-model' is not in the Hugging Face cache .* "
                                          r"\(HF_HUB_OFFLINE=1\): download it once .*`hf download org/some-model`.*"
                                          "local directory"):
        resolve_target(TargetConfig(model="org/some-model"))


def test_invalid_hub_id_is_a_config_error():
    with pytest.raises(ConfigError, match="neither an existing local directory nor a valid hub id"):
        load_target_config_and_tokenizer(TargetConfig(model="not a model id!", mask_token_id=0))


def test_unreachable_hub_model_is_a_config_error(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty cache: nothing to fall back on
    with pytest.raises(ConfigError, match="'peagle-test/no-such-model' is not in the Hugging Face cache"):
        load_target_config_and_tokenizer(TargetConfig(model="peagle-test/no-such-model", mask_token_id=0))


def _read_jsonl(name):
    return [json.loads(line) for line in (REPO_ROOT / "data" / "prompts" / name).read_text().splitlines()]


def test_committed_prompt_files_are_reproducible_and_split_correctly():
    recipe = EmbeddedTargetRecipe()
    train, held = _read_jsonl("code_train.jsonl"), _read_jsonl("code_eval.jsonl")
    assert len(train) == 2000 and len(held) == 64  # thousands of functions to train on
    for rec in train + held:
        assert [m["role"] for m in rec["messages"]] == ["user", "assistant"]
    assert len({r["id"] for r in train + held}) == len(train) + len(held)
    heldout_file = lambda rec: is_heldout(rec["id"].split("::")[0], recipe.heldout_fraction, recipe.seed)  # noqa: E731
    assert all(heldout_file(r) for r in held) and not any(heldout_file(r) for r in train)
    if platform.python_version() != GENERATED_WITH_PYTHON:
        pytest.skip(f"prompt files were made from Python {GENERATED_WITH_PYTHON}'s stdlib")
    assert embedded_prompt_messages("eval", 64, recipe) == held


def test_completion_prompts_are_the_held_out_functions_as_raw_code():
    held, completion = _read_jsonl("code_eval.jsonl"), _read_jsonl("code_completion_eval.jsonl")
    assert [r["id"] for r in completion] == [r["id"] for r in held]
    for chat, doc in zip(held, completion):
        assert set(doc) == {"id", "text"} and doc["text"].startswith(("def ", "async def ", "@"))
        assert doc["text"].rstrip("\n") in chat["messages"][0]["content"]  # the head the chat prompt asks about
        assert "```" not in doc["text"] and "Complete" not in doc["text"]
