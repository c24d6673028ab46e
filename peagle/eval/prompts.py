"""Evaluation prompt sets: JSON-lines files and public benchmarks, as the target sees them.

A set is a JSON-lines file (chat ``messages`` or ``prompt`` lines, or ``text`` lines of
completion traffic) or a benchmark name of ``HUB_PROMPT_SETS``. ``eval.prompts`` and
``eval.completion_prompts`` name the run's sets; ``check_eval_prompts`` reads them before
any heavy work. Importing this module is cheap: ``peagle config check`` uses it.
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
    "humaneval": ("openai/openai_humaneval", None, "test", "prompt"),
    "gsm8k": ("openai/gsm8k", "main", "test", "question"),
    "speed-bench": ("nvidia/SPEED-Bench", "qualitative", "test", "turns"),
}


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


def load_prompt_set(name_or_path: str, limit: int | None = None) -> list[list[dict]]:
    """Chat prompts (user turns) from a benchmark name in ``HUB_PROMPT_SETS`` or a JSON-lines path."""
    if name_or_path.lower() in HUB_PROMPT_SETS:
        return load_hub_prompts(name_or_path.lower(), limit)
    path = resolve_repo_path(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(
            f"prompt set {name_or_path!r}: no such file, and not one of {sorted(HUB_PROMPT_SETS)}"
        )
    return load_jsonl_prompts(path, limit)


def load_eval_prompts(cfg, completion: bool = False) -> list:
    """The run's evaluation prompts (``eval.prompts``, or ``eval.completion_prompts`` with
    ``completion``; the first ``eval.num_prompts``): a file relative to the repository, or a
    benchmark name. A missing or malformed file, or one with fewer than ``eval.num_prompts``
    prompts, is a ``ConfigError`` naming the key."""
    key = "eval.completion_prompts" if completion else "eval.prompts"
    name = cfg.eval.completion_prompts if completion else cfg.eval.prompts
    path = resolve_repo_path(name)
    try:
        prompts = load_prompt_set(str(path) if path.is_file() else name)
    except FileNotFoundError:
        raise ConfigError(f"{key}: {name!r} is neither a file ({path} does not exist) nor one of the benchmarks "
                          f"{sorted(HUB_PROMPT_SETS)}: fix {key}") from None
    except ValueError as err:
        raise ConfigError(f"{key}: {err}; fix the file or point {key} at another") from None
    wanted = cfg.eval.num_prompts
    if len(prompts) < wanted:
        where = path if path.is_file() else f"benchmark {name!r}"
        raise ConfigError(f"eval.num_prompts = {wanted}, but {key} ({where}) holds {len(prompts)} prompts: lower "
                          f"eval.num_prompts to at most {len(prompts)} or add prompts to the set")
    return prompts[:wanted]


def load_completion_prompts(cfg) -> list[str]:
    """``eval.completion_prompts`` as raw texts (none when unset); a chat set there is refused."""
    if not cfg.eval.completion_prompts:
        return []
    prompts = load_eval_prompts(cfg, completion=True)
    if not all(isinstance(p, str) for p in prompts):
        raise ConfigError(f"eval.completion_prompts={cfg.eval.completion_prompts!r} holds chat prompts; it needs "
                         '{"text": ...} lines (completion traffic), e.g. data/prompts/code_completion_eval.jsonl')
    return prompts


def check_eval_prompts(cfg, *, hub: bool = True) -> None:
    """Load both evaluation prompt sets once, so a missing, malformed or too short file fails
    before any heavy work, not hours later in the evaluate stage (an unreachable benchmark only
    warns; ``hub=False`` leaves benchmarks out: nothing is downloaded)."""
    for load, name in ((load_eval_prompts, cfg.eval.prompts), (load_completion_prompts, cfg.eval.completion_prompts)):
        if not hub and name and name.lower() in HUB_PROMPT_SETS and not resolve_repo_path(name).is_file():
            continue
        try:
            load(cfg)
        except PromptSetUnavailable as err:
            log.warning("%s", err)


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
