"""Prompt sources -> a deterministic, deduplicated mix of chat conversations and documents.

Each ``data.sources`` entry is a local JSON-lines / Parquet file or a Hugging Face
dataset in one of four schemas, normalised to messages:

- ``messages``:    a column of ``[{role, content}, ...]`` (OpenAI, UltraChat);
- ``sharegpt``:    a column of ``[{from, value}, ...]`` with ``human`` / ``gpt`` roles;
- ``instruction``: ``instruction`` (+ optional ``input``) and optional ``response`` /
  ``output`` (GSM-8K, OpenCodeInstruct, Alpaca);
- ``text``:        completion traffic: a ``text`` column (a code file, a document) the
  target continues without a chat template, and an optional ``completion`` (a
  reference continuation). Normalised to ``[{role: "prompt"}, {role: "completion"}]``
  (``COMPLETION_ROLES``): the chat template never renders these, and the loss is on
  every completion token (``peagle.data.chat``).

``fields`` maps the schema's names to the source's column (and key) names, e.g.
``{instruction: question, response: answer}``. Sources are mixed by ``weight`` under
``data.max_samples`` and each source's own ``max_samples``; rows are drawn in an order
fixed by ``data.seed``, so the same config always yields the same prompts.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import random
from collections import Counter
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from peagle.config import SCHEMA_FIELDS, ConfigError, DataConfig, PromptSource, resolve_repo_path
from peagle.fileio import json_digest

log = logging.getLogger(__name__)

REQUIRED_COLUMN = {"messages": "messages", "sharegpt": "conversations", "instruction": "instruction", "text": "text"}
COMPLETION_ROLES = ("prompt", "completion")  # a ``text`` sample: the document, then what follows it
ROLES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "bard": "assistant",
    "bing": "assistant",
}
_CHUNK = 2048


@dataclass(frozen=True)
class Conversation:
    id: str  # stable hash of the messages
    messages: list[dict]  # [{"role": ..., "content": ...}, ...]
    source: str


def conversation_id(messages: list[dict]) -> str:
    return json_digest([[m["role"], m["content"]] for m in messages])


def make_conversation(messages: list[dict], source: str) -> Conversation:
    return Conversation(id=conversation_id(messages), messages=messages, source=source)


def source_label(src: PromptSource) -> str:
    if src.kind == "hf":
        return f"hf:{src.path}" + (f"/{src.subset}" if src.subset else "") + f":{src.split}"
    return f"{src.kind}:{src.path}"


# ----------------------------------------------------------------------------- opening sources


def source_files(src: PromptSource, index: int = 0) -> list[Path]:
    """The files a local source (``jsonl``, ``parquet``, ``magpie``) names: its path, or what its
    glob matches. None found is a ConfigError naming the source: a local path is never taken
    for a hub dataset."""
    path = resolve_repo_path(src.path)
    found = sorted(Path(p) for p in glob.glob(str(path)))
    if not found:
        raise ConfigError(f"data.sources[{index}] ({source_label(src)}): file not found: {path}; fix "
                          f"data.sources[{index}].path (a Hugging Face dataset is named with kind: hf)")
    return found


def open_source(src: PromptSource, index: int = 0, commit: str | None = None):
    """The source as a ``datasets.Dataset``; a ConfigError naming it if it cannot be had. A hub
    set is read at ``commit`` when given (``peagle.data.provenance.hub_commits``: what the
    dataset's lineage records is what was read)."""
    import datasets

    where = f"data.sources[{index}] ({source_label(src)})"
    if src.kind != "hf":  # a magpie source's file is written before it is read
        files = source_files(src, index)
        path = resolve_repo_path(src.path)
        builder = "parquet" if src.kind == "parquet" else "json"
        try:
            with _datasets_quiet():  # a file that does not parse is named below, with its line
                return datasets.load_dataset(builder, data_files=str(path), split="train")
        except Exception as err:
            bad = first_bad_json_line(files) if builder == "json" else None
            raise ConfigError(f"{where}: {path} cannot be read as {src.kind}: {bad or _first_line(err)}; fix the "
                              f"file or data.sources[{index}].path") from None
    try:
        return datasets.load_dataset(src.path, src.subset, split=src.split, revision=commit)
    except Exception as err:
        offline = getattr(datasets.config, "HF_HUB_OFFLINE", False) or isinstance(err, ConnectionError)
        why = (
            "the Hugging Face Hub is unreachable (offline, HF_HUB_OFFLINE=1) and the dataset is not "
            f"in the local cache ({datasets.config.HF_DATASETS_CACHE}); download it where the hub is "
            "reachable, or export it to a jsonl/parquet file and use kind: jsonl/parquet"
            if offline
            else "check the dataset name, subset and split"
        )
        raise ConfigError(f"{where}: cannot load dataset {src.path!r}: {why} ({_first_line(err)})") from None


@contextlib.contextmanager
def _datasets_quiet():
    """``datasets`` without its progress bars and its own error lines (a local file's failure
    is reported by ``open_source``, naming the file and line), as it was afterwards."""
    import datasets

    bars, verbosity = datasets.is_progress_bar_enabled(), datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()


def first_bad_json_line(files: list[Path]) -> str | None:
    """Where the first line of JSON-lines ``files`` that is not a JSON object is, and why."""
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    return f"line {n} of {path.name} is not JSON ({err.msg}): one object per line"
                if not isinstance(row, dict):
                    return f"line {n} of {path.name} is a JSON {type(row).__name__}, not an object: one object per line"
    return None


def _first_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def resolve_fields(src: PromptSource, columns: list[str], index: int = 0) -> dict[str, str]:
    """The schema's field names mapped to this source's columns; errors name the fix."""
    defaults = {name: name for name in SCHEMA_FIELDS[src.schema_]}
    unknown = set(src.fields) - defaults.keys()
    if unknown:
        raise ConfigError(
            f"data.sources[{index}].fields: {sorted(unknown)} are not fields of schema "
            f"{src.schema_!r} (valid: {sorted(defaults)})"
        )
    fields = {**defaults, **src.fields}
    if src.schema_ == "instruction" and "response" not in src.fields and "response" not in columns:
        fields["response"] = "output"  # Alpaca / OpenCodeInstruct spell it "output"
    required = fields[REQUIRED_COLUMN[src.schema_]]
    if required not in columns:
        raise ConfigError(
            f"data.sources[{index}] ({source_label(src)}): schema {src.schema_!r} needs a column "
            f"{required!r} but the source has {columns}; set data.sources[{index}].fields."
            f"{REQUIRED_COLUMN[src.schema_]} to the right column"
        )
    return fields


# ----------------------------------------------------------------------------- schemas -> messages


def _clean(messages: list[dict]) -> list[dict] | None:
    """Keep well-formed conversations: known roles, text content, at least one user turn."""
    out = []
    for m in messages:
        role = ROLES.get(str(m.get("role", "")).lower())
        content = m.get("content")
        if role is None or not isinstance(content, str):
            return None
        out.append({"role": role, "content": content})
    if not any(m["role"] == "user" and m["content"].strip() for m in out):
        return None
    return out


def is_completion(messages: list[dict]) -> bool:
    """A ``text`` sample (completion traffic), not a chat conversation."""
    return bool(messages) and messages[0].get("role") == COMPLETION_ROLES[0]


def completion_messages(text: str, completion: str | None = None) -> list[dict]:
    """A document (and optionally its continuation) as a completion sample's messages."""
    messages = [{"role": COMPLETION_ROLES[0], "content": text}]
    if completion:
        messages.append({"role": COMPLETION_ROLES[1], "content": completion})
    return messages


def row_to_messages(row: dict, schema: str, fields: dict[str, str]) -> list[dict] | None:
    """One source row as messages, or None when the row is unusable."""
    if schema == "text":
        text, completion = row.get(fields["text"]), row.get(fields["completion"])
        if not isinstance(text, str) or not text.strip():
            return None
        return completion_messages(text, completion if isinstance(completion, str) and completion.strip() else None)
    if schema == "messages":
        turns = row.get(fields["messages"]) or []
        return _clean([{"role": t.get(fields["role"]), "content": t.get(fields["content"])} for t in turns])
    if schema == "sharegpt":
        turns = row.get(fields["conversations"]) or []
        return _clean([{"role": t.get(fields["from"]), "content": t.get(fields["value"])} for t in turns])
    instruction = row.get(fields["instruction"])
    if not isinstance(instruction, str) or not instruction.strip():
        return None
    extra = row.get(fields["input"])
    user = f"{instruction}\n\n{extra}" if isinstance(extra, str) and extra.strip() else instruction
    messages = [{"role": "user", "content": user}]
    system = row.get(fields["system"])
    if isinstance(system, str) and system.strip():
        messages.insert(0, {"role": "system", "content": system})
    response = row.get(fields["response"])
    if isinstance(response, str) and response.strip():
        messages.append({"role": "assistant", "content": response})
    return messages


def skip_reason(row: dict, schema: str, fields: dict[str, str]) -> str:
    """Why ``row_to_messages`` found a row unusable, as "N rows <reason>" reads."""
    if schema in ("text", "instruction"):
        column = fields[REQUIRED_COLUMN[schema]]
        return f"have no `{column}` text"
    column, role, content = (fields[name] for name in SCHEMA_FIELDS[schema])
    turns = row.get(column)
    if not turns or not isinstance(turns, list):
        return f"have no `{column}`"
    if not all(isinstance(t, dict) and ROLES.get(str(t.get(role, "")).lower()) for t in turns):
        return f"have a turn whose `{role}` is not one of {', '.join(sorted(set(ROLES)))}"
    if not all(isinstance(t.get(content), str) for t in turns):
        return f"have a turn whose `{content}` is not text"
    return "have no user turn with text"


@dataclass
class RowTally:
    """What the rows of one source read so far came to: kept, duplicates, and the rows skipped
    for each reason with the first such row's index."""

    read: int = 0
    kept: int = 0
    duplicates: int = 0
    skipped: Counter = field(default_factory=Counter)
    first: dict[str, int] = field(default_factory=dict)

    def skip(self, reason: str, row: int) -> None:
        self.skipped[reason] += 1
        self.first[reason] = min(row, self.first.get(reason, row))


def iter_conversations(ds, src: PromptSource, fields: dict[str, str], seed: int, index: int,
                       tally: RowTally | None = None) -> Iterator:
    """The source's usable conversations, in an order fixed by (seed, source index); ``tally``
    counts the rows read and those skipped, by reason."""
    tally = tally if tally is not None else RowTally()
    order = np.random.default_rng([seed, index]).permutation(len(ds))
    label = source_label(src)
    for a in range(0, len(order), _CHUNK):
        rows = order[a : a + _CHUNK].tolist()
        chunk = ds[rows]
        names = list(chunk)
        for row_index, values in zip(rows, zip(*(chunk[n] for n in names))):
            row = dict(zip(names, values))
            messages = row_to_messages(row, src.schema_, fields)
            tally.read += 1
            if messages is None:
                tally.skip(skip_reason(row, src.schema_, fields), row_index)
                continue
            yield make_conversation(messages, label)


def row_place(src: PromptSource, row: int) -> str:
    """Where row ``row`` (0-based) of a source is: its line in a JSON-lines file (the loader skips
    blank lines), else its row number."""
    path = resolve_repo_path(src.path) if src.kind == "jsonl" else None
    if path is not None and path.is_file():
        with open(path, encoding="utf-8", errors="replace") as fh:
            rows = (n for n, line in enumerate(fh, 1) if line.strip())
            line = next((n for i, n in enumerate(rows) if i == row), None)
        if line is not None:
            return f"line {line}"
    return f"row {row + 1}"


def tally_summary(src: PromptSource, tally: RowTally) -> str:
    """``80 rows have no `messages` (first: line 12); 3 duplicates``."""
    parts = [f"{n} row{'s' if n > 1 else ''} {reason if n > 1 else _singular(reason)} "
             f"(first: {row_place(src, tally.first[reason])})" for reason, n in tally.skipped.most_common()]
    if tally.duplicates:
        parts.append(f"{tally.duplicates} duplicate{'s' if tally.duplicates > 1 else ''}")
    return "; ".join(parts)


def _singular(reason: str) -> str:
    return "has" + reason.removeprefix("have") if reason.startswith("have") else reason


def report_skipped_rows(src: PromptSource, index: int, ds, tally: RowTally) -> None:
    """A warning naming the rows a source lost, or an error when none of them is usable."""
    if not tally.skipped:
        return
    where = f"data.sources[{index}] ({source_label(src)})"
    if tally.kept == 0 and sum(tally.skipped.values()) == tally.read:
        raise ConfigError(
            f"{where}: none of its {tally.read} rows is usable: {tally_summary(src, tally)}; fix the rows, "
            f"or data.sources[{index}].schema / .fields to match them"
        )
    rows = f"{tally.read} rows" if tally.read == len(ds) else f"the {tally.read} rows read (of {len(ds)})"
    log.warning("%s: kept %d of %s: %s", where, tally.kept, rows, tally_summary(src, tally))


# ----------------------------------------------------------------------------- mixing


def mix_quotas(available: list[int], weights: list[float], total: int | None) -> list[int]:
    """Rows to take from each source: proportional to weight, capped by availability.

    Sources that run out give their share to the others; rounding by largest remainder
    (ties to the earlier source), so the result is deterministic and sums to
    ``min(total, sum(available))``.
    """
    if total is None:
        return list(available)
    quotas = [0] * len(available)
    active = [i for i, a in enumerate(available) if a > 0]
    remaining = min(total, sum(available))
    while active:
        wsum = sum(weights[i] for i in active)
        capped = [i for i in active if remaining * weights[i] / wsum >= available[i]]
        if not capped:
            break
        for i in capped:
            quotas[i] = available[i]
            remaining -= available[i]
            active.remove(i)
    if active:
        wsum = sum(weights[i] for i in active)
        exact = {i: remaining * weights[i] / wsum for i in active}
        for i in active:
            quotas[i] = int(exact[i])
        left = remaining - sum(quotas[i] for i in active)
        for i in sorted(active, key=lambda i: (-(exact[i] - int(exact[i])), i))[:left]:
            quotas[i] += 1
    return quotas


def load_prompts(data_cfg: DataConfig, *, verbose: bool = False,
                 commits: dict[str, str | None] | None = None, skip: Collection[int] = ()) -> list[Conversation]:
    """All configured sources, mixed by weight, deduplicated, shuffled by ``data.seed``; the hub
    sets at ``commits`` (by source path) where given. ``skip``: indices of sources left out (not
    opened; the others keep their index, so their rows are drawn as in the full mix)."""
    opened = []
    for k, src in enumerate(data_cfg.sources):  # open every source first: config errors before work
        if k in skip:
            continue
        ds = open_source(src, k, (commits or {}).get(src.path))
        opened.append((k, src, ds, resolve_fields(src, ds.column_names, k)))
    available = [min(len(ds), src.max_samples or len(ds)) for _, src, ds, _ in opened]
    quotas = mix_quotas(available, [src.weight for _, src, _, _ in opened], data_cfg.max_samples)
    seen: set[str] = set()
    out: list[Conversation] = []
    for (k, src, ds, fields), quota in zip(opened, quotas):
        tally = RowTally()
        for conv in iter_conversations(ds, src, fields, data_cfg.seed, k, tally) if quota else ():
            if conv.id in seen:
                tally.duplicates += 1
                if data_cfg.dedup:
                    continue
                conv = replace(conv, id=f"{conv.id}-{tally.duplicates}")  # ids stay unique: they key the shards
            seen.add(conv.id)
            out.append(conv)
            tally.kept += 1
            if tally.kept == quota:
                break
        report_skipped_rows(src, k, ds, tally)
        if verbose:
            log.info("prompts: %s: %d of %d rows (quota %d, %d duplicates)", source_label(src), tally.kept, len(ds),
                     quota, tally.duplicates)
    if not out:
        raise ConfigError("data.sources yielded no usable conversation (every row was empty or malformed)")
    random.Random(data_cfg.seed).shuffle(out)
    return out


def check_heldout(n: int, prompts: int) -> None:
    """``data.heldout_samples`` must leave prompts to train on."""
    if n and n >= prompts:
        raise ConfigError(
            f"data.heldout_samples={n} leaves no training samples out of {prompts} prompts; "
            "lower it or add prompts"
        )


def split_heldout(
    convs: list[Conversation], n: int, seed: int, previous: dict[str, str] | None = None
) -> tuple[list[Conversation], list[Conversation]]:
    """(train, heldout): ``n`` conversations chosen by ``seed`` are held out for evaluation.

    ``previous`` (id -> "train"/"eval") keeps every conversation of an earlier run in
    the split it had, so a grown prompt set never moves a trained sample into the
    held-out split or back; only new conversations fill free held-out places.
    """
    if n == 0:
        return list(convs), []
    check_heldout(n, len(convs))
    previous = previous or {}
    order = list(range(len(convs)))
    random.Random(seed).shuffle(order)
    kept = [i for i in order if previous.get(convs[i].id) == "eval"][:n]
    fresh = [i for i in order if convs[i].id not in previous]
    held = set(kept + fresh[: n - len(kept)])
    train = [c for i, c in enumerate(convs) if i not in held]
    heldout = [c for i, c in enumerate(convs) if i in held]
    return train, heldout
