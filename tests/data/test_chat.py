"""The loss mask covers exactly the assistant turns, whatever the chat template looks like."""

import pytest

from peagle.data.chat import has_generation_markers, render_with_loss_mask

CONVERSATION = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Write a function that adds two numbers. Say hi first."},
    {"role": "assistant", "content": "hi\ndef add(a, b):\n    return a + b\n"},
    {"role": "user", "content": "Now reverse a string."},
    {"role": "assistant", "content": "def rev(s):\n    return s[::-1]  # réversé ✓ 🐍"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hi"},
]


def masked_runs(ids, mask):
    """Contiguous runs of masked token ids."""
    runs, current = [], []
    for t, m in zip(ids, mask):
        if m:
            current.append(t)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


def assistant_contents(messages, strip=False):
    return [m["content"].strip() if strip else m["content"] for m in messages if m["role"] == "assistant"]


@pytest.mark.parametrize(
    "name, strip", [("plain", False), ("marked", False), ("newline_trim", True), ("think", False)]
)
def test_masked_tokens_are_exactly_the_assistant_turns(make_tokenizer, templates, name, strip):
    tok = make_tokenizer(templates[name])
    assert has_generation_markers(tok) == (name == "marked")
    ids, mask = render_with_loss_mask(tok, CONVERSATION)

    assert ids == tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    assert len(mask) == len(ids)
    runs = masked_runs(ids, mask)
    end_id = tok.convert_tokens_to_ids("<|end|>")
    expected = assistant_contents(CONVERSATION, strip)
    assert len(runs) == len(expected)
    for run, content in zip(runs, expected):
        assert run[-1] == end_id, "the end-of-turn token closing an assistant message is supervised"
        assert tok.decode(run[:-1]) == content
    # Nothing else is supervised: not the user's identical "hi", headers or newlines.
    assert sum(mask) == sum(len(r) for r in runs)


def test_same_mask_with_and_without_markers(make_tokenizer, templates):
    """The prefix-diff path agrees token for token with transformers' assistant mask."""
    plain = render_with_loss_mask(make_tokenizer(templates["plain"]), CONVERSATION)
    marked = render_with_loss_mask(make_tokenizer(templates["marked"]), CONVERSATION)
    assert plain == marked


def test_template_that_rewrites_content_is_a_clear_error(make_tokenizer, templates):
    tok = make_tokenizer(templates["plain"].replace("m['content']", "m['content'] | upper"))
    with pytest.raises(ValueError, match="generation"):
        render_with_loss_mask(tok, CONVERSATION)


def test_no_assistant_turn_means_no_supervision(make_tokenizer, templates):
    ids, mask = render_with_loss_mask(make_tokenizer(templates["plain"]), [{"role": "user", "content": "hello"}])
    assert ids and not any(mask)


def test_tokenizer_without_template_is_a_clear_error(make_tokenizer):
    with pytest.raises(ValueError, match="no chat template"):
        render_with_loss_mask(make_tokenizer(None), CONVERSATION)


DOCUMENT = "def add(a, b):\n    \"\"\"Sum.\"\"\"\n"
CONTINUATION = "    return a + b  # réversé ✓\n\n\ndef sub(a, b):\n    return a - b\n"


@pytest.mark.parametrize("template", ["plain", None])
def test_completion_sample_has_no_chat_template_and_loss_on_every_continuation_token(make_tokenizer, templates,
                                                                                       template):
    tok = make_tokenizer(templates[template] if template else None)  # a base model without a template works too
    messages = [{"role": "prompt", "content": DOCUMENT}, {"role": "completion", "content": CONTINUATION}]
    ids, mask = render_with_loss_mask(tok, messages)
    prompt = tok(DOCUMENT)["input_ids"]
    assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])  # exactly what a completion request sends
    assert all(mask[len(prompt):]) and tok.decode(ids[len(prompt):]) == CONTINUATION
    role_tokens = {tok.convert_tokens_to_ids(t) for t in ("<|user|>", "<|assistant|>", "<|end|>")} - {tok.unk_token_id}
    assert not role_tokens & set(ids)  # no chat markup anywhere
    assert masked_runs(ids, mask) == [ids[len(prompt):]]
    ids, mask = render_with_loss_mask(tok, messages[:1])  # a document not continued yet: nothing to learn
    assert ids == prompt and not any(mask)
