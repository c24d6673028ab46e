"""Regenerate every assistant turn of a conversation with the target itself.

A drafter learns to predict the TARGET's continuations, so the responses it trains on
should be the target's own (the paper regenerates its prompts' responses). For each
conversation, assistant turn t is replaced by what the target writes given the chat
template of the already-regenerated history up to that turn (with
``add_generation_prompt=True``), sent as token ids. A conversation that ends with a user
turn gets one new assistant turn. Turns are processed in rounds (turn 1 of every
conversation, then turn 2, ...), each round batched through vLLM.

Everything the target emits is kept, reasoning/thinking text and special tokens
included (minus the stop token). A completion sample (``text`` schema: a document, then
its continuation) is continued from the document's own tokens, with no chat template, as
a completion request would be. A conversation that cannot be regenerated (a prompt
that does not fit ``max_model_len``, a malformed conversation) keeps its original
messages and records why in ``error``; it is never silently dropped.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from peagle.config import RegenerateConfig
from peagle.data.prompts import COMPLETION_ROLES, is_completion


@dataclass
class RegenResult:
    messages: list[dict]  # the conversation, every assistant turn written by the target
    error: str | None = None  # why it could not be regenerated (messages are then the original)
    finish_reasons: list[str] = field(default_factory=list)  # per regenerated turn: "stop" / "length"
    token_ids: list[list[int]] = field(default_factory=list)  # per regenerated turn, as generated

    @property
    def num_generated_tokens(self) -> list[int]:
        return [len(t) for t in self.token_ids]

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class _Work:
    """One conversation in flight: its history so far and the turns still to write."""

    key: int | str  # what seeds its sampled turns: the sample's id, else its position
    original: list[dict]
    pending: list[int]  # indices (in original) of the assistant turns still to write
    history: list[dict] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    result: RegenResult | None = None

    def fail(self, reason: str) -> None:
        self.result = RegenResult(self.original, reason, self.finish_reasons, self.token_ids)


def assistant_slots(messages: list[dict]) -> list[int]:
    """Where assistant turns go: each existing one, plus one after a final user turn (for a
    completion sample: the continuation after the document)."""
    if is_completion(messages):
        return [1]
    slots = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if messages and messages[-1].get("role") == "user":
        slots.append(len(messages))
    return slots


def conversation_problem(messages) -> str | None:
    """Why a conversation cannot be regenerated, or None."""
    if not isinstance(messages, list) or not messages:
        return "empty conversation"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"message {i} is not a {{'role': str, 'content': str}} mapping"
    if is_completion(messages):
        return None if messages[0]["content"].strip() else "the document to continue is empty"
    slots = assistant_slots(messages)
    if not slots:
        return "no assistant turn to regenerate and the conversation does not end with a user turn"
    if not any(m["role"] == "user" for m in messages[: slots[0]]):
        return "the first assistant turn has no user turn before it"
    return None


def regenerate_responses(
    llm,
    tokenizer,
    conversations: list[list[dict]],
    cfg: RegenerateConfig,
    progress: bool = True,
    *,
    seed: int | None = None,
    keys: list[str] | None = None,
) -> list[RegenResult]:
    """One ``RegenResult`` per conversation, in input order.

    ``tokenizer`` is the target's transformers tokenizer (its chat template renders the
    prompts). ``seed`` (else ``cfg.seed`` if the config has one) seeds each sampled turn
    by (conversation, turn), a conversation named by its ``keys`` entry (a sample id: the same
    answer whichever batch, resume or host regenerates it), else its position; greedy decoding
    (``cfg.temperature == 0``) needs none.
    Sampled regeneration needs a plain engine (not ``open_data_engine``'s).
    """
    from tqdm.auto import tqdm

    from peagle.serving.generation import check_sampling_supported
    from peagle.serving.pool import engine_max_model_len

    if not getattr(tokenizer, "chat_template", None) and not all(is_completion(c) for c in conversations):
        raise ValueError(
            f"the tokenizer of {getattr(tokenizer, 'name_or_path', 'the target')} has no chat template: "
            "regeneration renders conversations with it (set tokenizer.chat_template or use an instruct model)"
        )
    check_sampling_supported(llm, cfg.temperature)
    seed = seed if seed is not None else getattr(cfg, "seed", None)
    max_model_len = engine_max_model_len(llm)
    works = [_start(keys[i] if keys else i, conv) for i, conv in enumerate(conversations)]
    total_turns = sum(len(w.pending) for w in works if w.result is None)
    bar = tqdm(total=total_turns, desc="regenerate", unit="turn", disable=not progress)
    try:
        while active := [w for w in works if w.result is None]:
            for start in range(0, len(active), cfg.batch_size):
                chunk = active[start : start + cfg.batch_size]
                _run_round(llm, tokenizer, chunk, cfg, max_model_len, seed)
                bar.update(len(chunk))
    finally:
        bar.close()
    return [w.result for w in works]


def _start(key: int | str, conversation) -> _Work:
    work = _Work(key=key, original=conversation, pending=[])
    problem = conversation_problem(conversation)
    if problem:
        work.fail(problem)
        return work
    work.pending = assistant_slots(conversation)
    work.history = [dict(m) for m in conversation[: work.pending[0]]]
    return work


def _run_round(llm, tokenizer, chunk: list[_Work], cfg: RegenerateConfig, max_model_len: int, seed: int | None) -> None:
    """Write the next assistant turn of every conversation in ``chunk``."""
    from peagle.serving.generation import generate_from_token_ids

    ready, prompts, budgets, seeds = [], [], [], []
    for w in chunk:
        turn = len(w.finish_reasons)
        try:
            prompt = _render_prompt(tokenizer, w.history)
        except Exception as err:  # e.g. a template that insists on alternating roles
            w.fail(f"turn {turn + 1}: the chat template cannot render this conversation: {err}")
            continue
        if len(prompt) >= max_model_len:
            w.fail(
                f"turn {turn + 1}: the prompt has {len(prompt)} tokens, no room left under "
                f"vllm.max_model_len={max_model_len} (raise it or drop long conversations)"
            )
            continue
        ready.append(w)
        prompts.append(prompt)
        budgets.append(min(cfg.max_tokens, max_model_len - len(prompt)))
        seeds.append(_turn_seed(seed, w.key, turn))
    if not ready:
        return
    completions = generate_from_token_ids(
        llm, prompts, max_tokens=budgets, temperature=cfg.temperature, top_p=cfg.top_p, seeds=seeds
    )
    for w, c in zip(ready, completions, strict=True):
        _append_turn(w, c.text, c.finish_reason or "unknown", c.token_ids)


def _append_turn(w: _Work, text: str, finish_reason: str, token_ids: list[int]) -> None:
    """Put the target's turn in place, then the original messages up to the next turn."""
    slot = w.pending.pop(0)
    role = COMPLETION_ROLES[1] if is_completion(w.original) else "assistant"
    w.history.append({"role": role, "content": text})  # fresh: stale reasoning fields dropped
    w.finish_reasons.append(finish_reason)
    w.token_ids.append(list(token_ids))
    following = w.pending[0] if w.pending else len(w.original)
    w.history.extend(dict(m) for m in w.original[slot + 1 : following])
    if not w.pending:
        w.result = RegenResult(w.history, None, w.finish_reasons, w.token_ids)


def _render_prompt(tokenizer, history: list[dict]) -> list[int]:
    if is_completion(history):  # the document's tokens as a completion request sends them
        return [int(i) for i in tokenizer(history[0]["content"])["input_ids"]]
    ids = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding from older templates
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def _turn_seed(seed: int | None, conversation: int | str, turn: int) -> int | None:
    if seed is None:
        return None
    digest = hashlib.sha256(f"{seed}:{conversation}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little")
