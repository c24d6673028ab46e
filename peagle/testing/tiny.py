"""Tiny random-initialised Llama targets for format tests of everything that touches vLLM.

A few layers, a few thousand parameters, a byte-level BPE tokenizer trained on a few
sentences and a chat template with the same special tokens as the embedded target.
Weights are random, so these models are for checking shapes, plumbing and numerics
against transformers, never for quality.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>", "<|mask|>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "The quick brown fox jumps over the lazy dog.",
    "Write a function that reverses a string in Python.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
    "Explain what a hash map is and when to use one.",
]


def build_tiny_tokenizer(out_dir: Path, vocab_size: int = 384):
    """A byte-level BPE tokenizer with chat special tokens, saved as a HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|user|>", "<|assistant|>", "<|system|>", "<|mask|>"],
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(out_dir)
    return hf


def build_tiny_llama(
    out_dir: str | Path,
    *,
    num_layers: int = 4,
    hidden_size: int = 128,  # head_dim 32: the smallest vLLM's CPU attention supports
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 512,
    initializer_range: float = 0.05,
    seed: int = 0,
) -> Path:
    """Save a random fp32 Llama and its tokenizer to ``out_dir``; return the directory.

    ``initializer_range`` 0.05 (not 0.02) keeps residual-stream values of order 1 while
    spreading logits enough that greedy decoding agrees between implementations in fp32.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(out_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(out_dir)
    return out_dir
