"""Fixtures for the data tests: tiny tokenizers with chat templates, no model download."""

import pytest

# The tiny target's template: no {% generation %} markers, end token <|end|>.
PLAIN_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
# The same chat format with assistant text marked for transformers' assistant mask.
MARKED_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{{ '<|assistant|>' }}"
    "{% generation %}{{ m['content'] + '<|end|>' }}{% endgeneration %}"
    "{% else %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
# ChatML-like: newlines after headers and after the end token; content trimmed (Llama 3 does).
NEWLINE_TRIM_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + (m['content'] | trim) + '<|end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
# Not prefix-stable (like Qwen3): the LAST assistant turn gets an empty think block.
THINK_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and loop.last %}{{ '<|assistant|><think></think>' + m['content'] + '<|end|>' }}"
    "{% else %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


@pytest.fixture(scope="session")
def templates():
    return {"plain": PLAIN_TEMPLATE, "marked": MARKED_TEMPLATE, "newline_trim": NEWLINE_TRIM_TEMPLATE,
            "think": THINK_TEMPLATE}


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    from peagle.testing.tiny import build_tiny_tokenizer

    out = tmp_path_factory.mktemp("tiny_tokenizer")
    build_tiny_tokenizer(out)
    return out


@pytest.fixture
def make_tokenizer(tiny_tokenizer_dir):
    """A fresh tiny BPE tokenizer with the given chat template."""
    from transformers import AutoTokenizer

    def make(template: str | None):
        tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
        tok.chat_template = template
        return tok

    return make
