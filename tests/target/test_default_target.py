"""The real default target (slow: built once, ~4 minutes, then cached): it learned, and vLLM serves it."""

import json

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(embedded_target):
    return json.loads((embedded_target / "build_report.json").read_text())


def test_default_build_learned_code(report):
    """Measured on the committed recipe: held-out loss 4.77 vs 8.35 random, top-1 0.21 vs 0.0002."""
    trained, random_init = report["trained"], report["random_init"]
    assert report["recipe"]["num_layers"] == 8
    assert trained["heldout_loss"] < random_init["heldout_loss"] - 3.0
    assert trained["heldout_chat_loss"] < random_init["heldout_chat_loss"] - 3.0
    assert trained["heldout_top1_accuracy"] > 0.15 > 100 * random_init["heldout_top1_accuracy"]
    assert trained["greedy_token_prob"] > 50 * random_init["greedy_token_prob"]
    assert trained["greedy_match_rate"] > 10 * max(random_init["greedy_match_rate"], 0.002)
    assert "<|assistant|>\n```python\ndef " in report["sample_chat_completion"]  # it follows the template


def _generate_with_vllm(target_dir: str) -> list:
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from peagle.config import VllmConfig
    from peagle.serving.engine import open_llm

    tok = AutoTokenizer.from_pretrained(target_dir)
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"Complete this Python function:\n```python\n{head}\n```"}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for head in ('def is_even(n):\n    """Return True if n is even."""',
                     'def read_lines(path):\n    """Return the lines of a file."""')
    ]
    engine = VllmConfig(max_model_len=512, max_num_seqs=4, enforce_eager=True)
    with open_llm(target_dir, engine) as llm:
        return llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=96))


def test_vllm_serves_the_default_target_with_its_chat_template(embedded_target):
    outputs = _generate_with_vllm(str(embedded_target))
    assert len(outputs) == 2
    for out in outputs:
        completion = out.outputs[0]
        assert len(completion.token_ids) > 5
        assert completion.finish_reason in ("stop", "length")
        assert completion.text.startswith("```python\ndef ")  # it answers in the template's format
