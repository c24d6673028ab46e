"""The P-EAGLE mask token must be one the target never produces in the data.

P-EAGLE feeds the mask token's embedding to every parallel draft slot and trains that row
as the mask (``train.peagle.train_embeddings: mask_row``). A token that also occurs in ordinary
text (``self`` in code, say) would have its real embedding retrained into the mask, and
vLLM would then draft with it. The data stage counts the mask token in what it trains on:
the prompts, tokenised before any engine starts, and the rendered samples (prompts plus
the target's regenerated answers) before extraction. Any occurrence is refused, with the
count and the fix (a reserved or unused token, or ``target.mask_token_id``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from peagle.config import ConfigError, TargetConfig

_BATCH = 1024  # texts per tokenizer call


def mask_key(target: TargetConfig, tokenizer, mask_token_id: int) -> str:
    """The key that chose the mask token, as the user wrote it."""
    if target.mask_token_id is not None:
        return f"target.mask_token_id {mask_token_id} ({tokenizer.convert_ids_to_tokens(mask_token_id)!r})"
    return f"target.mask_token {target.mask_token!r} (id {mask_token_id})"


def unused_token_hint(tokenizer, mask_token_id: int) -> str:
    """A few of the tokenizer's reserved/unused special tokens, to suggest as the mask."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    names = [t.content for i, t in sorted(added.items())
             if i != mask_token_id and any(w in t.content.lower() for w in ("reserved", "unused", "mask"))]
    return f" (this tokenizer has e.g. {', '.join(repr(n) for n in names[:2])})" if names else ""


def count_in_texts(tokenizer, texts: Iterable[tuple[str, str]], mask_token_id: int) -> tuple[int, list[str]]:
    """(occurrences of ``mask_token_id`` when each text is tokenised, the names holding it);
    ``texts`` are (name, text) pairs, the texts of one name given one after the other."""
    total, holders, batch = 0, [], []

    def flush():
        nonlocal total
        ids = tokenizer([text for _, text in batch], add_special_tokens=False)["input_ids"]
        for (name, _), row in zip(batch, ids):
            n = sum(1 for t in row if t == mask_token_id)
            if n:
                total += n
                if not holders or holders[-1] != name:  # one name per text holder, its texts come together
                    holders.append(name)
        batch.clear()

    for item in texts:
        batch.append(item)
        if len(batch) == _BATCH:
            flush()
    if batch:
        flush()
    return total, holders


def refuse_if_used(count: int, holders: Sequence[str], of: int, what: str, key: str, hint: str) -> None:
    """A ``ConfigError`` with the count and the fix when the mask token occurs at all."""
    if not count:
        return
    raise ConfigError(
        f"{key} is a token the target produces in ordinary text: it occurs {count} time{'s' if count > 1 else ''} "
        f"in {len(holders)} of {of} {what} (first: {holders[0]}). P-EAGLE trains the mask token's embedding as "
        f"the mask, so it would retrain that real token's embedding: set target.mask_token to a reserved or unused "
        f"token of the tokenizer{hint}, or target.mask_token_id to an id no text produces"
    )


def check_prompts(records, tokenizer, target: TargetConfig, mask_token_id: int) -> None:
    """The mask token in the data stage's prompts (and answers restored from samples.jsonl),
    each message tokenised alone: checked before any engine starts."""
    texts = ((f"{r.source} sample {r.id}", m["content"]) for r in records for m in r.messages)
    count, holders = count_in_texts(tokenizer, texts, mask_token_id)
    refuse_if_used(count, holders, len(records), "prompts of data.sources", mask_key(target, tokenizer, mask_token_id),
                   unused_token_hint(tokenizer, mask_token_id))


def check_samples(records, tokenizer, target: TargetConfig, mask_token_id: int) -> None:
    """The mask token in the rendered samples (chat template, prompts and the target's answers)
    about to be extracted: what the drafter would train on."""
    ready = [r for r in records if r.status == "ok" and r.token_ids is not None]
    counts = {r.id: int((r.token_ids == mask_token_id).sum()) for r in ready}
    holders = [f"{r.source} sample {r.id}" for r in ready if counts[r.id]]
    refuse_if_used(sum(counts.values()), holders, len(ready), "samples rendered with the chat template (prompts and "
                   "the target's answers)", mask_key(target, tokenizer, mask_token_id),
                   unused_token_hint(tokenizer, mask_token_id))
