"""Evaluation prompts must not be training prompts: a head that saw a prompt's answer during
training accepts more on it than on anything a user sends, and the number says nothing.

Prompts are compared by their request (the first user turn, or a completion document), with
whitespace collapsed and case folded, before any engine starts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from peagle.config import ConfigError

REQUEST_ROLES = ("user", "prompt")  # a chat request, or a completion sample's document


def request_key(prompt: Sequence[dict] | str) -> str:
    """What a prompt asks, normalised: a chat prompt's first user turn, or a raw document."""
    if isinstance(prompt, str):
        text = prompt
    else:
        text = next((m.get("content") or "" for m in prompt if m.get("role") in REQUEST_ROLES), "")
    return " ".join(text.split()).casefold()


def check_no_overlap(training: Iterable[Sequence[dict]], eval_sets: Mapping[str, Sequence]) -> None:
    """Refuse evaluation prompts whose request is also a training prompt's, naming the set, how
    many and the first of them."""
    trained = {request_key(messages) for messages in training} - {""}
    problems = []
    for name, prompts in eval_sets.items():
        shared = [p for p in prompts if request_key(p) in trained]
        if shared:
            first = request_key(shared[0])
            problems.append(f"{len(shared)} of {len(prompts)} prompts of eval set {name!r} "
                            f"(first: {first[:80]!r})")
    if problems:
        raise ConfigError(
            "evaluation prompts also appear in the training prompts: " + "; ".join(problems)
            + ". Acceptance measured on them would overstate what users get: drop them from data.sources, "
            "or evaluate on another set (eval.prompts)"
        )
