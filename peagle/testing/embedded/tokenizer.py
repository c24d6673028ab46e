"""Byte-level BPE tokenizer for the embedded target, with a chat template.

The template marks assistant content with ``{% generation %}`` so that
``apply_chat_template(..., return_assistant_tokens_mask=True)`` gives the loss mask,
and the assistant turn ends with ``<|end|>`` (the eos), which vLLM stops on.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from peagle.testing.embedded.corpus import SPECIAL_TOKENS

USER, ASSISTANT, END, MASK, PAD = SPECIAL_TOKENS

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}"
    "{{ '<|user|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\\n' }}{% generation %}{{ message['content'] + '<|end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "{{ raise_exception('the embedded target only knows user and assistant turns, not ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train byte-level BPE; the special tokens get ids 0-4, in SPECIAL_TOKENS order."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def wrap_tokenizer(tok: Tokenizer, model_max_length: int) -> PreTrainedTokenizerFast:
    """The transformers tokenizer that is saved with the model (eos = ``<|end|>``)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=END,
        pad_token=PAD,
        mask_token=MASK,
        additional_special_tokens=[USER, ASSISTANT],
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def render_chat(messages: list[dict]) -> str:
    """The exact training text of one conversation (what the chat template renders)."""
    parts = []
    for m in messages:
        if m["role"] == "user":
            parts.append(f"{USER}\n{m['content']}{END}\n")
        elif m["role"] == "assistant":
            parts.append(f"{ASSISTANT}\n{m['content']}{END}\n")
        else:
            raise ValueError(f"the embedded target only knows user and assistant turns, not {m['role']}")
    return "".join(parts)
