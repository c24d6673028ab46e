"""The served split: the evaluation prompts as vLLM serves them, for offline acceptance.

Offline acceptance predicts vLLM's only when it is simulated on what vLLM decodes: the
evaluation prompts (the first set of ``eval.prompts``, its first ``eval.num_prompts``), tokenised exactly
as the online evaluation sends them, followed by the target's own greedy tokens as vLLM
produces them. The held-out split is neither (other prompts, responses re-tokenised
through the chat template, another length), so acceptance simulated on it overestimates
vLLM's.

Each sample is ``prompt ids + generated ids`` with the loss mask on the generated ids.
The target generates ``eval.max_tokens + max(eval.ks)`` tokens: vLLM verifies a draft
against the target's tokens even where they run past ``max_tokens`` (and counts them as
accepted before it truncates the output), so the simulation needs them too; the manifest
records ``max_tokens``, the budget after which the simulation stops drafting.

Built by the data stage with its engine (no extra engine start) into
``<data>/splits/served/`` (spread over hosts, by the first part: ``peagle.data.parts``); a
change of the prompts, their number, the budget or K rebuilds this split only (its manifest
keeps ``served_key``); an interrupted or repaired split of the same key is finished, not redone. Not part of a head's identity: it
measures heads, it does not train them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

from peagle.config import PipelineConfig, resolve_repo_path
from peagle.fileio import json_digest, sha256_file
from peagle.layout import MANIFEST_FILE, DataLayout

log = logging.getLogger(__name__)

SERVED_SPLIT = "served"


def served_key(cfg: PipelineConfig) -> str:
    """What decides the served split: the prompt set (its file's contents), how many, the
    generation budget, the largest K, the engine's length limit."""
    first = cfg.eval.prompts[0]
    path = resolve_repo_path(first)
    source = sha256_file(path) if path.is_file() else first
    return json_digest([source, cfg.eval.num_prompts, cfg.eval.max_tokens, max(cfg.eval.ks), cfg.vllm.max_model_len])


def served_manifest(data: DataLayout) -> dict | None:
    """The complete served split's manifest, or None when the dataset has none."""
    path = data.manifest(SERVED_SPLIT)
    if not path.exists():
        return None
    manifest = json.loads(path.read_text())
    return manifest if manifest.get("complete") and manifest.get("num_samples") else None


def eval_token_prompts(cfg: PipelineConfig, tokenizer) -> list[list[int]]:
    """The evaluation prompts as token ids, exactly as the online evaluation sends them."""
    from peagle.data.prompt_sets import fit_prompts, load_eval_prompts, tokenize_prompts

    prompts = tokenize_prompts(load_eval_prompts(cfg), tokenizer)
    return fit_prompts(prompts, cfg.vllm.max_model_len, cfg.eval.max_tokens, max(cfg.eval.ks))


def served_is_current(cfg: PipelineConfig, data: DataLayout) -> bool:
    manifest = served_manifest(data)
    return manifest is not None and manifest.get("served_key") == served_key(cfg)


def served_tokens_to_extract(cfg: PipelineConfig, tokenizer, data: DataLayout) -> tuple[int, int]:
    """(tokens, longest sequence) the served split will still store: every eval prompt plus
    its generation budget, none when the split is current or cannot be built here."""
    from peagle.data.prompt_sets import NoPromptFits, PromptSetUnavailable

    if served_is_current(cfg, data):
        return 0, 0
    try:
        prompts = eval_token_prompts(cfg, tokenizer)
    except (PromptSetUnavailable, NoPromptFits):
        return 0, 0
    budget = cfg.eval.max_tokens + max(cfg.eval.ks)
    lengths = [len(p) + budget for p in prompts]
    return sum(lengths), max(lengths, default=0)


def _keep_or_clear(split_dir, meta: dict) -> None:
    """Keep an unfinished served split made with the same ``meta`` (served_key included): its
    writer finishes it. Anything else there is removed."""
    manifest_path = split_dir / MANIFEST_FILE
    try:
        old = json.loads(manifest_path.read_text()) if manifest_path.exists() else None
    except ValueError:
        old = None
    if old is None or any(old.get(k) != v for k, v in meta.items()):
        shutil.rmtree(split_dir, ignore_errors=True)


def take_served_split(cfg: PipelineConfig, data: DataLayout, parts: list[DataLayout]) -> bool:
    """Move a part's current served split into ``data`` when ``data`` has none (the first part
    of a data stage spread over hosts builds it, so taking the parts in needs no engine);
    whether ``data``'s served split is current now."""
    if served_is_current(cfg, data):
        return True
    for part in parts:
        if served_is_current(cfg, part):
            shutil.rmtree(data.split(SERVED_SPLIT), ignore_errors=True)
            data.splits_dir.mkdir(parents=True, exist_ok=True)
            os.replace(part.split(SERVED_SPLIT), data.split(SERVED_SPLIT))
            log.info("data: served split taken in from %s", part.root)
            return True
    return False


def build_served_split(llm, tokenizer, cfg: PipelineConfig, data: DataLayout, layer_ids: list[int],
                       hidden_size: int, meta: dict) -> bool:
    """Write ``<data>/splits/served`` with ``llm`` (a data engine).

    Returns False (with a warning) when the prompt set cannot be loaded here (an
    unreachable hub benchmark) or no prompt fits the engine: offline acceptance then falls
    back to the held-out split (the online evaluation will say the same about its prompts).
    """
    from peagle.data.extract import extract_with_engine
    from peagle.data.prompt_sets import NoPromptFits, PromptSetUnavailable
    from peagle.data.store import ShardWriter
    from peagle.serving.generation import generate_from_token_ids

    key = served_key(cfg)
    try:
        prompts = eval_token_prompts(cfg, tokenizer)
    except (PromptSetUnavailable, NoPromptFits) as err:
        log.warning("data: no served split (offline acceptance uses the held-out split): %s", err)
        return False
    budget = cfg.eval.max_tokens + max(cfg.eval.ks)
    split_meta = {**meta, "served_key": key, "max_tokens": cfg.eval.max_tokens, "prompt_set": cfg.eval.prompts[0]}
    _keep_or_clear(data.split(SERVED_SPLIT), split_meta)
    with ShardWriter(data.split(SERVED_SPLIT), layer_ids, hidden_size, cfg.data.storage_dtype,
                     cfg.data.shard_max_tokens, split_meta) as writer:
        todo = {f"served-{i:05d}": p for i, p in enumerate(prompts) if f"served-{i:05d}" not in writer.done_ids()}
        log.info("data: served split: %d eval prompts%s, %d greedy tokens each (%d + K)", len(todo),
                 f" ({len(prompts) - len(todo)} stored before)" if len(todo) < len(prompts) else "", budget,
                 cfg.eval.max_tokens)
        completions = generate_from_token_ids(llm, list(todo.values()), max_tokens=[budget] * len(todo)) if todo else []
        sequences = {sid: (p, c.token_ids) for (sid, p), c in zip(todo.items(), completions, strict=True)}
        pairs = [(sid, p + g) for sid, (p, g) in sequences.items()]
        for sid, hidden in extract_with_engine(llm, pairs, batch_size=cfg.data.extract_batch_size, progress=False):
            prompt, generated = sequences[sid]
            writer.add(sid, prompt + generated, [False] * len(prompt) + [True] * len(generated), hidden)
    return True
