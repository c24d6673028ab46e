"""The served split: the evaluation prompts as vLLM serves them, for offline acceptance.

Offline acceptance predicts vLLM's only when it is simulated on what vLLM decodes: the
evaluation prompts (``eval.prompts``, the first ``eval.num_prompts``), tokenised exactly
as the online evaluation sends them, followed by the target's own greedy tokens as vLLM
produces them. The held-out split is neither (other prompts, responses re-tokenised
through the chat template, another length), and measured on the embedded target it
overestimated vLLM by 12-31% at K = 5.

Each sample is ``prompt ids + generated ids`` with the loss mask on the generated ids.
The target generates ``eval.max_tokens + max(eval.ks)`` tokens: vLLM verifies a draft
against the target's tokens even where they run past ``max_tokens`` (and counts them as
accepted before it truncates the output), so the simulation needs them too; the manifest
records ``max_tokens``, the budget after which the simulation stops drafting.

Built by the data stage with its engine (no extra engine start) into
``<data>/splits/served/``; a change of the prompts, their number, the budget or K
rebuilds this split only (its manifest keeps ``served_key``). Not part of a head's
identity: it measures heads, it does not train them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil

from peagle.config import PipelineConfig, resolve_repo_path
from peagle.layout import DataLayout

log = logging.getLogger(__name__)

SERVED_SPLIT = "served"


def served_key(cfg: PipelineConfig) -> str:
    """What decides the served split: the prompt set (its file's contents), how many, the
    generation budget, the largest K, the engine's length limit."""
    path = resolve_repo_path(cfg.eval.prompts)
    source = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else cfg.eval.prompts
    parts = [source, cfg.eval.num_prompts, cfg.eval.max_tokens, max(cfg.eval.ks), cfg.vllm.max_model_len]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def served_manifest(data: DataLayout) -> dict | None:
    """The complete served split's manifest, or None when the dataset has none."""
    path = data.manifest(SERVED_SPLIT)
    if not path.exists():
        return None
    manifest = json.loads(path.read_text())
    return manifest if manifest.get("complete") and manifest.get("num_samples") else None


def eval_token_prompts(cfg: PipelineConfig, tokenizer) -> list[list[int]]:
    """The evaluation prompts as token ids, exactly as the online evaluation sends them."""
    from peagle.eval.online import fit_prompts
    from peagle.eval.prompts import load_eval_prompts, tokenize_prompts

    prompts = tokenize_prompts(load_eval_prompts(cfg), tokenizer)
    return fit_prompts(prompts, cfg.vllm.max_model_len, cfg.eval.max_tokens, max(cfg.eval.ks))


def served_is_current(cfg: PipelineConfig, data: DataLayout) -> bool:
    manifest = served_manifest(data)
    return manifest is not None and manifest.get("served_key") == served_key(cfg)


def build_served_split(llm, tokenizer, cfg: PipelineConfig, data: DataLayout, layer_ids: list[int],
                       hidden_size: int, meta: dict) -> bool:
    """Write ``<data>/splits/served`` with ``llm`` (a data engine).

    Returns False (with a warning) when the prompt set cannot be loaded here (an
    unreachable hub benchmark) or no prompt fits the engine: offline acceptance then falls
    back to the held-out split (the online evaluation will say the same about its prompts).
    """
    from peagle.data.extract import extract_with_engine
    from peagle.data.store import ShardWriter
    from peagle.eval.online import NoPromptFits
    from peagle.eval.prompts import PromptSetUnavailable
    from peagle.serving.generation import generate_from_token_ids

    key = served_key(cfg)
    try:
        prompts = eval_token_prompts(cfg, tokenizer)
    except (PromptSetUnavailable, NoPromptFits) as err:
        log.warning("data: no served split (offline acceptance uses the held-out split): %s", err)
        return False
    shutil.rmtree(data.split(SERVED_SPLIT), ignore_errors=True)
    budget = cfg.eval.max_tokens + max(cfg.eval.ks)
    log.info("data: served split: %d eval prompts, %d greedy tokens each (%d + K)", len(prompts), budget,
             cfg.eval.max_tokens)
    completions = generate_from_token_ids(llm, prompts, max_tokens=[budget] * len(prompts))
    sequences = {f"served-{i:05d}": (p, c.token_ids) for i, (p, c) in enumerate(zip(prompts, completions))}
    split_meta = {**meta, "served_key": key, "max_tokens": cfg.eval.max_tokens, "prompt_set": cfg.eval.prompts}
    with ShardWriter(data.split(SERVED_SPLIT), layer_ids, hidden_size, cfg.data.storage_dtype,
                     cfg.data.shard_max_tokens, split_meta) as writer:
        pairs = [(sid, p + g) for sid, (p, g) in sequences.items()]
        for sid, hidden in extract_with_engine(llm, pairs, batch_size=cfg.data.extract_batch_size, progress=False):
            prompt, generated = sequences[sid]
            writer.add(sid, prompt + generated, [False] * len(prompt) + [True] * len(generated), hidden)
    return True
