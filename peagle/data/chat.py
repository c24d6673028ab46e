"""Conversations -> token ids + loss mask, with the target tokenizer's own chat template;
completion samples (``text`` schema) without one.

A completion sample is the document's tokens as a completion request sends them (the
tokenizer's own special tokens, e.g. BOS, included) followed by its continuation's
tokens; the loss mask is True on every continuation token, False on the document.

The drafter is trained only where the target speaks: the loss mask is True on the
tokens of every assistant message (its content and the end-of-turn token that closes
it) and False on system/user turns and on the template's role headers.

Two ways to find those tokens:
- templates that mark assistant text with ``{% generation %}`` let transformers return
  the mask (``return_assistant_tokens_mask``);
- other templates are rendered twice, once with each assistant content replaced by a
  sentinel; diffing the two renders gives each content's exact character span (robust
  to headers, trimming and think blocks that a text search would trip over), and the
  tokenizer's offsets map spans to tokens. Empty assistant messages are not supervised.
"""

from __future__ import annotations

import re

from peagle.data.prompts import is_completion

_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
_SENTINEL = re.compile(r"PEAGLESENTINEL(\d+)X")


def has_generation_markers(tokenizer) -> bool:
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("default", "")
    return bool(template) and bool(_GENERATION_TAG.search(template))


def render_with_loss_mask(tokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """Token ids of the whole conversation and a mask that is True on assistant tokens (on
    the continuation of a completion sample)."""
    if is_completion(messages):
        return render_completion(tokenizer, messages)
    if not tokenizer.chat_template:
        raise ValueError(
            f"tokenizer {tokenizer.name_or_path!r} has no chat template; the target must be a chat "
            "model (set tokenizer.chat_template in its tokenizer_config.json)"
        )
    if has_generation_markers(tokenizer):
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
    return _render_with_sentinels(tokenizer, messages)


def render_completion(tokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """A document + its continuation, no chat template: loss on every continuation token."""
    prompt = [int(i) for i in tokenizer(messages[0]["content"])["input_ids"]]
    text = messages[1]["content"] if len(messages) > 1 else ""
    completion = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]] if text else []
    return prompt + completion, [False] * len(prompt) + [True] * len(completion)


def _render_with_sentinels(tokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = _assistant_char_spans(tokenizer, messages, text)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    special = _special_ids(tokenizer)
    mask = [False] * len(ids)
    t = 0
    for start, end in spans:  # spans ascend, so one sweep over the tokens
        while t < len(ids) and offsets[t][1] <= start:
            t += 1
        while t < len(ids) and offsets[t][0] < end:  # every token overlapping the content
            mask[t] = True
            t += 1
        if t < len(ids) and ids[t] in special:  # the end-of-turn token that closes it
            mask[t] = True
    return ids, mask


def _special_ids(tokenizer) -> set[int]:
    """Named special tokens plus every added token flagged special (e.g. Llama 3's <|eot_id|>)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return set(tokenizer.all_special_ids) | {i for i, tok in added.items() if getattr(tok, "special", False)}


def _assistant_char_spans(tokenizer, messages: list[dict], text: str) -> list[tuple[int, int]]:
    """Character span of each (non-empty) assistant message's content inside ``text``.

    The conversation is rendered again with each assistant content replaced by a unique
    sentinel; walking both renders side by side puts every content at its exact place,
    even where the template adds text around it (headers, think blocks, trimming).
    """
    marked = [dict(m) for m in messages]
    contents = {}
    for i, m in enumerate(marked):
        if m["role"] == "assistant" and m["content"]:
            contents[i] = m["content"]
            m["content"] = f"PEAGLESENTINEL{i}X"
    skeleton = tokenizer.apply_chat_template(marked, tokenize=False)
    spans, pos_s, pos_t = [], 0, 0
    for match in _SENTINEL.finditer(skeleton):
        literal = skeleton[pos_s : match.start()]
        if not text.startswith(literal, pos_t):
            break
        pos_t += len(literal)
        content = contents.get(int(match.group(1)), "")
        variants = (content, content.strip(), content.rstrip(), content.lstrip())  # templates may trim
        found = next((c for c in variants if c and text.startswith(c, pos_t)), None)
        if found is None:
            break
        spans.append((pos_t, pos_t + len(found)))
        pos_t += len(found)
        pos_s = match.end()
    if skeleton[pos_s:] != text[pos_t:] or len(spans) < len(contents):
        raise ValueError(
            "cannot locate the assistant messages in the rendered conversation: the chat template "
            "rewrites message text; add {% generation %} / {% endgeneration %} markers around the "
            "assistant content in the template"
        )
    return spans
