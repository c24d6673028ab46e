"""`peagle data` refuses a mask token the target produces in ordinary text, with the count and
the fix, before any vLLM engine starts: in the prompts, and in the rendered samples."""

import json

import pytest

from tests.peagle_cli import assert_refused, peagle
from tests.support.conversations import CONVERSATIONS


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from peagle.testing.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("mask") / "target", num_layers=8)


def data_command(tmp_path, target, mask_token: str):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    config = tmp_path / "config.yaml"
    config.write_text(f"""\
name: mask
workdir: {tmp_path / "run"}
target: {{model: {target}, dtype: float32, mask_token: {json.dumps(mask_token)}}}
vllm: {{max_model_len: 192, max_num_seqs: 8, cpu_kvcache_space_gib: 1}}
data:
  sources: [{{kind: jsonl, path: {prompts}}}]
  heldout_samples: 2
  max_seq_len: 64
  regenerate: {{enabled: false}}
  draft_vocab_size: 64
train: {{recipe: {{max_len: 64}}, peagle: {{k_train: 5}}}}
eval: {{max_tokens: 16}}
""")
    return peagle("data", config, env={"PEAGLE_HOME": str(tmp_path / "home")})


def occurrences(tokenizer, token_id: int, texts) -> tuple[int, int]:
    counts = [tokenizer(t, add_special_tokens=False)["input_ids"].count(token_id) for t in texts]
    return sum(counts), sum(1 for c in counts if c)


@pytest.mark.slow
def test_a_mask_token_in_the_prompts_is_refused_before_any_engine_starts(tmp_path, tiny_target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    self_id = tok.convert_tokens_to_ids("self")
    assert self_id != tok.unk_token_id
    count, _ = occurrences(tok, self_id, [m["content"] for c in CONVERSATIONS for m in c])
    holders = sum(1 for c in CONVERSATIONS if occurrences(tok, self_id, [m["content"] for m in c])[0])
    assert count >= 2

    result = data_command(tmp_path, tiny_target, "self")
    assert_refused(result, f"target.mask_token 'self' (id {self_id}) is a token the target produces in ordinary text: "
                           f"it occurs {count} times in {holders} of {len(CONVERSATIONS)} prompts of data.sources",
                   "set target.mask_token to a reserved or unused token of the tokenizer (this tokenizer has e.g. "
                   "'<|mask|>'), or target.mask_token_id")
    assert not (tmp_path / "run" / "data" / "splits").exists()  # nothing extracted, no engine started


@pytest.mark.slow
def test_a_mask_token_the_chat_template_writes_is_refused_before_extraction(tmp_path, tiny_target):
    """`<|end|>` closes every turn: no prompt text holds it, every rendered sample does."""
    from transformers import AutoTokenizer

    end_id = AutoTokenizer.from_pretrained(tiny_target).convert_tokens_to_ids("<|end|>")
    result = data_command(tmp_path, tiny_target, "<|end|>")
    assert_refused(result, f"target.mask_token '<|end|>' (id {end_id}) is a token the target produces in ordinary "
                           f"text: it occurs {2 * len(CONVERSATIONS)} times in {len(CONVERSATIONS)} of "
                           f"{len(CONVERSATIONS)} samples rendered with the chat template",
                   "target.mask_token_id")
    assert not list((tmp_path / "run").rglob("*.safetensors"))
