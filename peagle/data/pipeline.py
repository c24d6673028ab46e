"""The data stage: prompts -> target responses -> hidden states -> shards + draft vocabulary.

``build_dataset`` writes ``<run>/data/`` (format in docs/design.md, "Dataset"):

1. check every input before anything is written or removed (``peagle.data.preflight``, which
   ``peagle config check`` runs too): the eval prompt sets, the
   draft vocabulary size, the target's tokenizer, every prompt source (loaded and mixed; a
   ``kind: magpie`` source's file written after the other checks, ``peagle.data.synthesize``; each source named
   by what was read, ``peagle.data.provenance``, for the dataset's lineage), no eval prompt
   among them (``peagle.data.contamination``), no mask token in them (``peagle.data.mask_token``);
   hold out ``data.heldout_samples`` for evaluation;
2. check the shards already stored (once per file identity, ``peagle.data.store``): a
   corrupt one is refused, pointing at ``--repair``, which (as ``force`` does) takes it
   out so its samples are extracted again;
3. check the disk can hold everything still to write, every split and vLLM's scratch
   files, with each regenerated response counted at its longest (before any vLLM work);
4. regenerate every assistant turn with the target (vLLM), persisted to
   ``samples.jsonl`` as each batch finishes, so a rerun never regenerates twice;
5. render each conversation with the target's chat template + assistant loss mask,
   drop sequences shorter than ``data.min_tokens`` and TRUNCATE longer ones to
   ``data.max_seq_len`` (recorded per sample as ``truncated_from``); refuse a mask token the
   rendered samples contain; report the answers' health (``peagle.data.health``); check the
   disk again with the real lengths;
6. extract the hidden states of ``facts.stored_layer_ids`` (same vLLM engine) into
   train/eval shards, a shard at least every ``FLUSH_EVERY_S`` seconds; samples already in
   a shard are skipped on a rerun; then the served split (``peagle.data.served``: the eval
   prompts as vLLM decodes them, what offline acceptance is simulated on);
7. build the draft vocabulary from the TRAIN split's supervised tokens and save
   ``vocab.safetensors``, ``target_facts.json`` and the final ``samples.jsonl``; commit
   (``build.json``).

A full disk at any point stops the stage at once with ``DiskSpaceError``: which disk,
what is kept (the shards and regenerated responses written so far) and how to resume
(rerun the same command).

The dataset owns the target's facts only; the drafter's shape is the checkpoint's
(``peagle.facts``), so changing the ``drafter`` section never needs new data.

The config hash (``target`` + ``data`` sections) is stored in every manifest and, when a
build completes, in ``build.json``. A dataset of another configuration is never touched
unless ``force``: then the new one is built beside it (``RunLayout.data_rebuild``) and
replaces it only once complete, so a failed or interrupted rebuild leaves the old dataset
whole (rerun to finish the rebuild). Regenerated responses carry the key of what they
depend on (``regeneration_key``: the target, its revision, the regeneration settings)
and are reused by any build with the same key, a rebuild included.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections import Counter
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from peagle.config import ConfigError, PipelineConfig
from peagle.data import mask_token
from peagle.data.budget import data_budget, expected_samples
from peagle.data.chat import render_with_loss_mask
from peagle.data.check import mend_corrupt_shards
from peagle.data.errors import DiskSpaceError
from peagle.data.parts import Part, finished_parts, mark_done, part_layout
from peagle.data.preflight import check_data_inputs
from peagle.data.prompts import COMPLETION_ROLES, Conversation, split_heldout
from peagle.data.provenance import hub_commits, source_digests
from peagle.data.regenerate import assistant_slots
from peagle.data.served import (
    SERVED_SPLIT,
    build_served_split,
    served_is_current,
    served_tokens_to_extract,
    take_served_split,
)
from peagle.data.store import (
    ShardReader,
    ShardWriter,
    check_free_space,
    estimate_bytes,
    format_bytes,
    free_bytes,
    mount_point,
    stored_samples,
)
from peagle.data.synthesize import synthesize_prompts
from peagle.data.vocab import build_draft_vocab, count_tokens
from peagle.facts import TargetFacts
from peagle.fileio import atomic_open, is_disk_full, json_digest, publish_dir, write_json_atomic
from peagle.interrupt import interrupted
from peagle.layout import SAMPLES_FILE, SPLITS, TRAIN_SPLIT, DataLayout, RunLayout
from peagle.logs import console_stream
from peagle.serving.engine import with_data_parallel_replicas

log = logging.getLogger(__name__)

FLUSH_EVERY_S = 60.0  # extraction writes a shard at least this often: what a crash or a full disk can lose
SCRATCH_BYTES_PER_VALUE = 4  # vLLM's hidden-states files hold the engine's dtype: float32 at most
TEXT_BYTES_PER_TOKEN = 8  # samples.jsonl: a token of regenerated text as escaped JSON, generously


@dataclass
class DatasetInfo:
    data_dir: Path
    train_dir: Path
    eval_dir: Path
    vocab_path: Path
    facts_path: Path
    num_train: int
    num_eval: int
    num_tokens: int
    num_failed: int
    bytes_on_disk: int
    config_hash: str
    # what the build read: each prompt source (by its configured path) named by content, a
    # magpie file as written, a hub set at its commit (``peagle.data.provenance``)
    prompt_files: dict[str, str] = field(default_factory=dict)


@dataclass
class Record:
    """One prompt's journey; a line of samples.jsonl."""

    id: str
    split: str
    source: str
    messages: list[dict]
    regen: str | None = None  # None: not regenerated; "ok"; or "failed: reason"
    regen_key: str | None = None  # what the response was regenerated with (``regeneration_key``)
    status: str = "ok"  # "ok" or "failed: reason"
    num_tokens: int | None = None
    truncated_from: int | None = None
    finish_reasons: list[str] = field(default_factory=list)
    token_ids: torch.Tensor | None = field(default=None, repr=False)  # int32, in memory only
    loss_mask: torch.Tensor | None = field(default=None, repr=False)  # bool

    def line(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("token_ids", "loss_mask")}
        return {k: v for k, v in d.items() if v is not None and v != []}


@dataclass(frozen=True)
class BuildPlan:
    """Where a build writes, and what it replaces once it is complete."""

    layout: DataLayout  # where the shards, samples.jsonl and vocabulary are written
    final: DataLayout  # the run's dataset directory (``RunLayout.data``)
    replaces: str | None = None  # config hash of the dataset in ``final`` that this build replaces
    reuse: tuple[Path, ...] = ()  # samples.jsonl files of other builds whose responses may be reused
    obsolete: tuple[Path, ...] = ()  # unfinished rebuilds of other configurations, removed on commit

    @property
    def in_place(self) -> bool:
        return self.layout.root == self.final.root


def build_dataset(
    cfg: PipelineConfig, target_path: str, facts: TargetFacts, progress: bool = True, force: bool = False, *,
    repair: bool = False, target_revision: str | None = None, config_hint: str = "CONFIG",
) -> DatasetInfo:
    """Build (or finish building, or repair) the dataset of ``cfg`` for the target at ``target_path``.

    ``force``: replace a dataset of another configuration (built beside it, swapped in when
    complete), extract the samples of corrupt shards again, and write even when the disk
    looks too small. ``repair``: extract the samples of corrupt shards again.
    ``target_revision`` (``peagle.lineage``) ties regenerated responses to the target's content.
    Parts built on other hosts (``build_part``) are taken in; ``config_hint`` is how messages
    name the config.
    """
    config_hash = cfg.section_hash("target", "data")
    draft_vocab_size = cfg.data.draft_vocab_size or facts.vocab_size
    final_facts = facts.with_draft_vocab(draft_vocab_size)  # ConfigError now rather than after extraction
    tokenizer = target_tokenizer(cfg, target_path)
    prompts, read = read_prompts(cfg, target_path, tokenizer, facts, force, write_requests=True)
    plan = plan_build(RunLayout(cfg.run_dir), config_hash, force=force, repair=repair)
    parts = finished_parts(plan.layout, config_hash, config_hint)  # every part complete, before any work
    check_budget(cfg, facts, expected_samples(cfg, len(prompts), [], []), plan.layout, force)
    key = regeneration_key(cfg, target_revision) if cfg.data.regenerate.enabled else None
    layout = plan.layout
    try:
        previous = previous_samples(plan, first=tuple(part.samples for part in parts))  # the parts' answers reused
        records = plan_records(cfg, prompts, previous, key)
        fill_dataset(layout, records, cfg, target_path, facts, tokenizer, key, progress, force=force,
                     mend=repair or force, parts=parts)
        write_samples(layout.samples, records)
        vocab = build_draft_vocab(count_tokens(ShardReader(layout.train, verify=False), facts.vocab_size),
                                  draft_vocab_size)
        vocab.save(layout.vocab)
        final_facts.save(layout.facts)
        commit(plan, config_hash, key)
    except KeyboardInterrupt:
        log.warning(f"data: interrupted. {kept_summary(plan)} Rerun the same command to go on from there.")
        raise
    except Exception as err:
        if interrupted():  # the Ctrl-C reached vLLM's engines first: they died of it, not of a fault
            log.warning(f"data: interrupted. {kept_summary(plan)} Rerun the same command to go on from there.")
            raise KeyboardInterrupt from err
        if not is_disk_full(err):
            raise
        raise DiskSpaceError(out_of_space_message(plan, err)) from err
    info = dataset_info(plan.final.root, config_hash, records, read)
    log.info(
        f"data: {info.num_train} train + {info.num_eval} eval samples, {info.num_tokens} tokens, "
        f"{info.num_failed} failed, {format_bytes(info.bytes_on_disk)} in {info.data_dir}"
    )
    for reason, count in failure_reasons(records).most_common(5):
        log.info(f"  {count} x {reason}")
    return info


@dataclass(frozen=True)
class PartInfo:
    """A finished part of the data stage (``build_part``)."""

    part: str  # "I/N"
    part_dir: str
    num_samples: int  # records of this part, held-out ones included
    num_ok: int  # of which stored
    num_tokens: int


def build_part(
    cfg: PipelineConfig, target_path: str, facts: TargetFacts, part: Part, progress: bool = True,
    force: bool = False, *, target_revision: str | None = None, config_hint: str = "CONFIG",
) -> PartInfo:
    """Regenerate and extract ``part``'s slice of the records into its own store beside the
    dataset (``peagle.data.parts``); the build that follows takes it in. Reads the same prompts
    as every other part: a Magpie file not yet written is refused (``write_requests`` first)."""
    config_hash = cfg.section_hash("target", "data")
    facts.with_draft_vocab(cfg.data.draft_vocab_size or facts.vocab_size)  # ConfigError now, as the build's
    tokenizer = target_tokenizer(cfg, target_path)
    prompts, _ = read_prompts(cfg, target_path, tokenizer, facts, force, write_requests=False,
                              config_hint=config_hint)
    plan = plan_build(RunLayout(cfg.run_dir), config_hash, force=force, repair=False)
    layout = part_layout(plan.layout, part)
    layout.root.mkdir(parents=True, exist_ok=True)
    key = regeneration_key(cfg, target_revision) if cfg.data.regenerate.enabled else None
    records = part.take(plan_records(cfg, prompts, previous_samples(plan, last=(layout.samples,)), key))
    check_budget(cfg, facts, len(records), layout, force)
    try:
        fill_dataset(layout, records, cfg, target_path, facts, tokenizer, key, progress, force=force, mend=force,
                     served=part.index == 0)  # the first part's engine builds the served split too
    except Exception as err:
        if not is_disk_full(err):
            raise
        raise DiskSpaceError(f"the disk of {layout.root} filled up while building data part {part.index}/"
                             f"{part.count} ({err}); what is written is kept: free space and rerun the same "
                             "command") from err
    write_samples(layout.samples, records)
    mark_done(layout, part, config_hash, len(records))
    ok = [r for r in records if r.status == "ok"]
    info = PartInfo(f"{part.index}/{part.count}", str(layout.root), len(records), len(ok),
                    sum(r.num_tokens for r in ok))
    log.info(f"data part {info.part}: {info.num_ok} of {info.num_samples} samples stored ({info.num_tokens} tokens) "
             f"in {layout.root}; once every part is done, `peagle data {config_hint}` takes them into one dataset")
    return info


def write_requests(cfg: PipelineConfig, target_path: str, facts: TargetFacts, force: bool = False) -> int:
    """Write the requests of the config's ``kind: magpie`` sources that are not written yet,
    once, before the parts of a data stage spread over hosts read them; the prompts read."""
    prompts, _ = read_prompts(cfg, target_path, target_tokenizer(cfg, target_path), facts, force,
                              write_requests=True)
    return len(prompts)


def target_tokenizer(cfg: PipelineConfig, target_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        target_path, revision=cfg.target.revision, trust_remote_code=cfg.target.trust_remote_code
    )


def read_prompts(cfg: PipelineConfig, target_path: str, tokenizer, facts: TargetFacts, force: bool, *,
                 write_requests: bool, config_hint: str = "CONFIG") -> tuple[list[Conversation], dict[str, str]]:
    """Every input checked before any engine starts (what ``peagle config check`` runs too), the
    Magpie requests written when ``write_requests`` (else refused if missing); the prompts and
    the sources as read (``peagle.data.provenance``)."""
    commits = hub_commits(cfg.data.sources)  # resolved once: the hub sets are read at these commits
    read = source_digests(cfg.data.sources, commits)  # before reading: a file grown meanwhile counts as new
    inputs = check_data_inputs(cfg, tokenizer, facts.mask_token_id, commits=commits, verbose=True)
    if inputs.unwritten and not write_requests:
        files = ", ".join(str(s.path) for s in inputs.unwritten)
        raise ConfigError(f"the Magpie requests of {files} are not written yet, and every part of the data stage must "
                          f"read the same prompts: write them once first (`peagle data {config_hint} --requests-only`; "
                          "the Prefect data flow does it before it starts the parts)")
    if inputs.unwritten:  # magpie sources: the requests the target writes itself, then read with the rest
        check_budget(cfg, facts, expected_samples(cfg, len(inputs.prompts), inputs.unwritten, []),
                     RunLayout(cfg.run_dir).data, force)
        synthesize_prompts(cfg, target_path, tokenizer)
        read = source_digests(cfg.data.sources, commits)
        inputs = check_data_inputs(cfg, tokenizer, facts.mask_token_id, commits=commits, verbose=True)
    return inputs.prompts, read


def fill_dataset(layout: DataLayout, records: list[Record], cfg: PipelineConfig, target_path: str,
                 facts: TargetFacts, tokenizer, key: str | None, progress: bool, *, force: bool, mend: bool,
                 parts: list[DataLayout] = (), served: bool = True) -> None:
    """Regenerate, render and extract whatever ``layout`` does not hold yet of ``records``,
    after taking in the shards of ``parts``; the served split too when ``served``."""
    mend_corrupt_shards(layout, mend)
    max_len = min(cfg.data.max_seq_len, cfg.vllm.max_model_len - 1)  # extraction needs one spare position
    meta = {"config_hash": cfg.section_hash("target", "data"), "target": cfg.target.model,
            "target_revision": cfg.target.revision}
    with ExitStack() as stack:
        writers = {
            split: stack.enter_context(ShardWriter(
                layout.split(split), stored_layers(cfg, facts, split), facts.target_hidden_size,
                cfg.data.storage_dtype, cfg.data.shard_max_tokens, meta, max_buffer_s=FLUSH_EVERY_S,
            ))
            for split in SPLITS
        }
        take_in_parts(writers, parts)
        take_served_split(cfg, layout, parts)
        stored = set().union(*(w.done_ids() for w in writers.values()))
        engine = _LazyEngine(stack, cfg, target_path, facts, layout.work)
        pending = [r for r in records if key is not None and r.regen is None]
        pending_ids = {r.id for r in pending}
        render_records(tokenizer, [r for r in records if r.id not in pending_ids], cfg, max_len, progress)
        served_tokens = served_tokens_to_extract(cfg, tokenizer, layout) if served else (0, 0)
        if pending:
            bounds = regenerated_length_bounds(tokenizer, pending, cfg, max_len)
            check_disk(space_needed(cfg, facts, records, stored, bounds, served_tokens, layout.samples), layout.root,
                       force, f"data: {len(pending)} prompts to regenerate and "
                       f"{sum(r.id not in stored for r in records)} sequences to extract (each response at its longest)")
            with engine.for_regeneration() as llm:
                regenerate(llm, tokenizer, pending, cfg, layout.samples, progress, key)
            render_records(tokenizer, pending, cfg, max_len, progress)
        require_training_samples(records)
        mask_token.check_samples(records, tokenizer, cfg.target, facts.mask_token_id)  # the answers too
        report_health(records, layout, cfg)
        todo = [r for r in records if r.status == "ok" and r.id not in stored]
        tokens_only = [r for r in todo if not stored_layers(cfg, facts, r.split)]  # a streamed train split
        todo = [r for r in todo if stored_layers(cfg, facts, r.split)]
        truncated = sum(r.truncated_from is not None for r in todo + tokens_only)
        nl, ht = len(facts.stored_layer_ids), facts.target_hidden_size
        check_disk(space_needed(cfg, facts, records, stored, {}, served_tokens, layout.samples), layout.root, force,
                   f"data: {len(todo)} sequences ({sum(r.num_tokens for r in todo)} tokens) to extract ({nl} layers x "
                   f"{ht} x {cfg.data.storage_dtype})"
                   + (f" and {len(tokens_only)} train sequences ({sum(r.num_tokens for r in tokens_only)} tokens) to "
                      "store as tokens (data.hidden_states: streamed)" if tokens_only else "")
                   + f", {truncated} truncated to {cfg.data.max_seq_len}")
        store_tokens(writers[TRAIN_SPLIT], tokens_only, ht)
        if todo:
            extract_into(engine.get(), todo, writers, cfg, progress)
        if served and not served_is_current(cfg, layout):
            build_served_split(engine.get(), tokenizer, cfg, layout, facts.stored_layer_ids,
                               facts.target_hidden_size, meta)


def take_in_parts(writers: dict[str, ShardWriter], parts: list[DataLayout]) -> None:
    """Move the shards of finished parts into the build's splits, in part order."""
    if not parts:
        return
    taken = sum(writers[split].adopt(part.split(split)) for part in parts for split in SPLITS)
    log.info(f"data: {taken} samples taken in from {len(parts)} parts built apart")


# ----------------------------------------------------------------------------- where a build goes


def committed_hash(layout: DataLayout) -> str | None:
    """The config hash of the finished build in ``layout`` (its build.json), or None."""
    try:
        return json.loads(layout.build.read_text())["config_hash"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def dataset_hash(layout: DataLayout) -> str | None:
    """The configuration ``layout`` holds data of: its build.json's, else its shards' (an
    unfinished first build), else None (nothing built)."""
    committed = committed_hash(layout)
    if committed is not None:
        return committed
    for split in (*SPLITS, SERVED_SPLIT):
        try:
            found = json.loads(layout.manifest(split).read_text()).get("config_hash")
        except (OSError, ValueError, AttributeError):
            continue
        if found:
            return found
    return None


def plan_build(run: RunLayout, config_hash: str, *, force: bool, repair: bool) -> BuildPlan:
    """Where this build writes. A dataset of another configuration in ``run.data`` is refused
    (``ConfigError``) unless ``force``, and never touched before its replacement is complete."""
    data = run.data
    rebuild = run.data_rebuild(config_hash)
    if committed_hash(rebuild) == config_hash:  # complete, but its swap was interrupted
        publish_dir(rebuild.root, data.root)
    old = dataset_hash(data)
    others = [r for r in run.data_rebuilds() if r.root != rebuild.root]
    if old is None or old == config_hash:
        for other in others:
            log.info(f"data: {other.root} holds an unfinished rebuild of another configuration; `peagle data "
                     "--force` with that configuration finishes it, or delete it")
        return BuildPlan(data, data)
    if repair:
        raise ConfigError(
            f"{data.root} holds a dataset of another configuration (config hash {old}, now {config_hash}): "
            "--repair mends a dataset with the configuration it was built with; pass that one, or use --force "
            "to build this configuration's dataset"
        )
    if rebuild.root.is_dir():
        log.info(f"data: finishing the rebuild in {rebuild.root} (config {old} -> {config_hash}); "
                 f"{data.root} stays as it is until the rebuild is complete")
    elif not force:
        raise ConfigError(
            f"{data.root} holds a dataset built with another configuration (config hash {old}, now "
            f"{config_hash}: the target or data section changed); rerun with --force to build the new one (the "
            "old one stays until the new one is complete and replaces it), or give this run another name/workdir"
        )
    else:
        log.info(f"data: config changed ({old} -> {config_hash}), --force: building the new dataset in "
                 f"{rebuild.root}; {data.root} stays as it is until the new one is complete")
        rebuild.root.mkdir(parents=True, exist_ok=True)  # parts of several hosts may start it at once
    return BuildPlan(rebuild, data, replaces=old, reuse=(data.samples, *(o.samples for o in others)),
                     obsolete=tuple(o.root for o in others))


def commit(plan: BuildPlan, config_hash: str, key: str | None) -> None:
    """Mark the build complete (build.json, written last); a rebuild then replaces the old dataset.
    The parts it took in are gone with it: their shards are the dataset's now."""
    write_json_atomic(plan.layout.build, {"config_hash": config_hash, "regen_key": key}, indent=None)
    shutil.rmtree(plan.layout.parts_dir, ignore_errors=True)
    if plan.in_place:
        return
    publish_dir(plan.layout.root, plan.final.root)  # the old tree is moved aside, then deleted
    for path in plan.obsolete:
        shutil.rmtree(path, ignore_errors=True)
    log.info(f"data: the new dataset (config {config_hash}) replaced the old one ({plan.replaces}) in {plan.final.root}")


def regeneration_key(cfg: PipelineConfig, target_revision: str | None) -> str:
    """What a regenerated response depends on: the target (its config and content revision),
    the regeneration settings and seed, and the engine's length limit. Responses are reused
    by any build with the same key (a rebuild for another ``data`` setting included)."""
    payload = {
        "target": cfg.target.model_dump(mode="json", by_alias=True),
        "target_revision": target_revision,
        "regenerate": cfg.data.regenerate.model_dump(mode="json", by_alias=True),
        "seed": cfg.data.seed,
        "max_model_len": cfg.vllm.max_model_len,
    }
    return json_digest(payload)


# ----------------------------------------------------------------------------- disk


def regenerated_length_bounds(tokenizer, records: list[Record], cfg: PipelineConfig, max_len: int) -> dict[str, int]:
    """The most tokens each conversation can have once the target has written its turns: the
    conversation with every assistant turn empty, plus ``regenerate.max_tokens`` (and an end
    token) per turn, at most ``max_len``."""
    per_turn = cfg.data.regenerate.max_tokens + 1
    bounds = {}
    for r in records:
        slots = assistant_slots(r.messages)
        try:
            ids, _ = render_with_loss_mask(tokenizer, _emptied_turns(r.messages, slots))
            bounds[r.id] = min(max_len, len(ids) + per_turn * len(slots))
        except Exception:  # noqa: BLE001 - it fails again, with its reason, when rendered for real
            bounds[r.id] = max_len
    return bounds


def _emptied_turns(messages: list[dict], slots: list[int]) -> list[dict]:
    """The conversation with an empty turn at each place the target writes one."""
    from peagle.data.prompts import COMPLETION_ROLES, is_completion

    role = COMPLETION_ROLES[1] if is_completion(messages) else "assistant"
    out = [dict(m) for m in messages]
    for i in slots:
        if i < len(out):
            out[i]["content"] = ""
        else:
            out.append({"role": role, "content": ""})
    return out


def space_needed(cfg: PipelineConfig, facts: TargetFacts, records: list[Record], stored: set[str],
                 bounds: dict[str, int], served: tuple[int, int], samples: Path) -> dict[str, int]:
    """Bytes this build still writes, by what writes them: each split's shards, vLLM's
    scratch files (one per sequence of an extraction batch, in the engine's dtype) and the
    regenerated text. ``bounds``: the longest each pending response can make its sequence."""
    ht = facts.target_hidden_size
    tokens, longest = Counter(), 0
    for r in records:
        if r.id in stored:
            continue
        n = bounds.get(r.id, r.num_tokens if r.status == "ok" and r.num_tokens else 0)
        tokens[r.split] += n
        longest = max(longest, n)
    served_tokens, served_longest = served
    tokens[SERVED_SPLIT] += served_tokens
    longest = max(longest, served_longest)
    need = {f"{split} shards": estimate_bytes(n, len(stored_layers(cfg, facts, split)), ht, cfg.data.storage_dtype)
            for split, n in tokens.items() if n}
    if longest:
        nl = len(facts.stored_layer_ids)
        need["vLLM scratch files"] = cfg.data.extract_batch_size * longest * nl * ht * SCRATCH_BYTES_PER_VALUE
    if bounds:  # appended as regenerated, then samples.jsonl is rewritten whole beside itself
        current = samples.stat().st_size if samples.exists() else 0
        need["regenerated text"] = current + 2 * sum(bounds.values()) * TEXT_BYTES_PER_TOKEN
    return need


def check_budget(cfg: PipelineConfig, facts: TargetFacts, samples: int | None, layout: DataLayout,
                 force: bool) -> None:
    """Before any work: the dataset at its largest (``peagle.data.budget``: every prompt, every
    sequence at ``data.max_seq_len``) fits the disk, less what a resumed build already stored; a
    stored one that cannot is refused naming ``data.hidden_states: streamed`` (``force``: warn)."""
    budget = data_budget(cfg, len(facts.stored_layer_ids), facts.target_hidden_size, samples)
    held = [layout, *(DataLayout(p) for p in sorted(layout.parts_dir.glob("*-of-*")))]  # parts move in: no new disk
    stored = sum(json.loads(d.manifest(s).read_text()).get("bytes", 0)
                 for d in held for s in (*SPLITS, SERVED_SPLIT) if d.manifest(s).exists())
    problem = budget.shortfall(already_stored=stored)
    if problem is None:
        return
    if not force:
        raise DiskSpaceError(f"{problem} (--force writes anyway)")
    log.warning(problem)


def check_disk(need: dict[str, int], data_dir: Path, force: bool, doing: str) -> None:
    """Refuse (``DiskSpaceError``) unless the disk holds ``need``; log what is needed and free."""
    total = sum(need.values())
    breakdown = " + ".join(f"{what} {format_bytes(n)}" for what, n in need.items()) or "nothing"
    free = check_free_space(data_dir, total, force, what=f"this data build ({breakdown})")
    log.info(f"{doing}: {format_bytes(total)} on disk ({breakdown}); {format_bytes(free)} free")


def kept_summary(plan: BuildPlan) -> str:
    """What a stopped build leaves for the next run: its shards and regenerated responses."""
    layout = plan.layout
    kept = {split: stored_samples(layout.split(split)) for split in (*SPLITS, SERVED_SPLIT)}
    responses = sum(d.get("regen") == "ok" for d in read_samples(layout.samples).values())
    stored = ", ".join(f"{n} {split}" for split, n in kept.items())
    old = "" if plan.in_place else f" {plan.final.root} is unchanged."
    return (f"Kept in {layout.root}: {stored} samples in shards and {responses} regenerated responses "
            f"({SAMPLES_FILE}).{old}")


def out_of_space_message(plan: BuildPlan, err: BaseException) -> str:
    """What a full disk stopped, what is kept, and how to go on."""
    disk = mount_point(plan.layout.root)
    return (
        f"the disk holding {plan.layout.root} ({disk}) is full ({err}); {format_bytes(free_bytes(disk))} free now. "
        f"{kept_summary(plan)} Free space on {disk} (or point `workdir` or PEAGLE_HOME at a larger disk), then "
        "rerun the same command: it goes on from what is kept."
    )


# ----------------------------------------------------------------------------- records


def previous_samples(plan: BuildPlan, first: tuple[Path, ...] = (), last: tuple[Path, ...] = ()) -> dict[str, dict]:
    """Earlier samples.jsonl lines by id: ``first``, other builds' (the replaced dataset,
    unfinished rebuilds), this build's own, then ``last``; a later file's line wins."""
    merged: dict[str, dict] = {}
    for path in (*first, *plan.reuse, plan.layout.samples, *last):
        merged.update(read_samples(path))
    return merged


def plan_records(cfg: PipelineConfig, prompts: list[Conversation], previous: dict[str, dict],
                 key: str | None) -> list[Record]:
    """Every prompt as a Record, with earlier regenerated responses of the same ``key``
    (``regeneration_key``; None: regeneration is off) restored."""
    splits = {sample_id: rec.get("split") for sample_id, rec in previous.items()}
    train, heldout = split_heldout(prompts, cfg.data.heldout_samples, cfg.data.seed, splits)
    records = []
    for split, convs in (("train", train), ("eval", heldout)):
        for conv in convs:
            records.append(_record(conv, split, previous.get(conv.id), key))
    restored = sum(r.regen is not None for r in records)
    log.info(
        f"data: {len(train)} train + {len(heldout)} held-out prompts"
        + (f"; {restored} regenerated responses restored from {SAMPLES_FILE}" if restored else "")
    )
    return records


def _record(conv: Conversation, split: str, previous: dict | None, key: str | None) -> Record:
    reusable = (
        key is not None and previous and previous.get("regen") and previous.get("split") == split
        and previous.get("regen_key") == key
    )
    if reusable:
        return Record(conv.id, split, conv.source, previous["messages"], regen=previous["regen"], regen_key=key,
                      finish_reasons=previous.get("finish_reasons", []))
    return Record(conv.id, split, conv.source, conv.messages)


def read_samples(path: Path) -> dict[str, dict]:
    """id -> latest line of samples.jsonl (a line cut short by a crash is ignored)."""
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                continue
            out[d["id"]] = d
    return out


def append_samples(path: Path, records: list[Record]) -> None:
    """Append and fsync: once this returns the lines survive a crash."""
    with open(path, "a") as fh:
        for r in records:
            fh.write(json.dumps(r.line(), ensure_ascii=False) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def write_samples(path: Path, records: list[Record]) -> None:
    """The final samples.jsonl: exactly one line per prompt (atomic rewrite)."""
    with atomic_open(path) as fh:
        for r in records:
            fh.write(json.dumps(r.line(), ensure_ascii=False) + "\n")


# ----------------------------------------------------------------------------- vLLM work


class _LazyEngine:
    """Starts the one data engine (regeneration + extraction) only if some work needs it."""

    def __init__(self, stack: ExitStack, cfg: PipelineConfig, target_path: str, facts: TargetFacts, work_dir: Path):
        self.stack, self.cfg, self.target_path, self.facts, self.work_dir = stack, cfg, target_path, facts, work_dir
        self.llm = None

    def get(self):
        if self.llm is None:
            from peagle.data.extract import open_data_engine

            vllm_cfg = with_data_parallel_replicas(self.cfg.vllm)
            replicas = vllm_cfg.data_parallel_size
            log.info(f"data: starting vLLM for {self.target_path}"
                     + (f" ({replicas} engine replicas)" if replicas > 1 else ""))
            t = self.cfg.target
            self.llm = self.stack.enter_context(open_data_engine(
                self.target_path, vllm_cfg, self.facts.stored_layer_ids, self.work_dir,
                revision=t.revision, trust_remote_code=t.trust_remote_code, dtype=t.dtype,
            ))
        return self.llm

    def for_regeneration(self):
        """Greedy regeneration shares the extraction engine; sampling gets a plain engine of its
        own, closed before extraction (vLLM 0.32's extraction engine samples wrongly at T > 0)."""
        if self.cfg.data.regenerate.temperature == 0:
            return nullcontext(self.get())
        from peagle.serving.pool import open_engines

        t = self.cfg.target
        log.info(f"data: starting vLLM for sampled regeneration with {self.target_path}")
        return open_engines(self.target_path, self.cfg.vllm, revision=t.revision,
                            trust_remote_code=t.trust_remote_code, dtype=t.dtype)


def regenerate(llm, tokenizer, records: list[Record], cfg: PipelineConfig, samples_path: Path, progress: bool,
               key: str | None = None) -> None:
    """Target-written assistant turns, saved batch by batch (with their ``regeneration_key``)
    so a crash loses one batch at most."""
    from peagle.data.regenerate import regenerate_responses

    rcfg = cfg.data.regenerate
    chunk = 4 * rcfg.batch_size
    bar = tqdm(total=len(records), desc="regenerate", unit="conv", disable=not progress, file=console_stream())
    for start in range(0, len(records), chunk):
        batch = records[start : start + chunk]
        results = regenerate_responses(llm, tokenizer, [r.messages for r in batch], rcfg, progress=False,
                                       seed=cfg.data.seed, keys=[r.id for r in batch])
        for r, res in zip(batch, results, strict=True):
            r.messages = res.messages
            r.regen = "ok" if res.error is None else f"failed: {res.error}"
            r.regen_key = key
            r.finish_reasons = list(res.finish_reasons)
        append_samples(samples_path, batch)
        bar.update(len(batch))
    bar.close()


def stored_layers(cfg: PipelineConfig, facts: TargetFacts, split: str) -> list[int]:
    """The layers whose hidden states ``split`` stores: none for a streamed train split, whose
    hidden states are extracted while training (``peagle.data.spool``)."""
    if split == TRAIN_SPLIT and cfg.data.hidden_states == "streamed":
        return []
    return facts.stored_layer_ids


def store_tokens(writer: ShardWriter, records: list[Record], hidden_size: int) -> None:
    """The samples of a streamed split: token ids and loss mask, no hidden states."""
    for r in records:
        writer.add(r.id, r.token_ids, r.loss_mask, torch.empty(len(r.token_ids), 0, hidden_size))


def extract_into(llm, records: list[Record], writers: dict[str, ShardWriter], cfg: PipelineConfig,
                 progress: bool) -> None:
    from peagle.data.extract import extract_with_engine

    by_id = {r.id: r for r in records}
    for sample_id, hidden in extract_with_engine(llm, _Sequences(records), batch_size=cfg.data.extract_batch_size,
                                                 progress=progress):
        r = by_id[sample_id]
        writers[r.split].add(sample_id, r.token_ids, r.loss_mask, hidden)


class _Sequences:
    """(id, token id list) per record, made on the fly; has a length for the progress bar."""

    def __init__(self, records: list[Record]):
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self):
        return ((r.id, r.token_ids.tolist()) for r in self.records)


# ----------------------------------------------------------------------------- tokens


def render_records(tokenizer, records: list[Record], cfg: PipelineConfig, max_len: int, progress: bool) -> None:
    """Token ids + loss mask for each usable record; failures get a status saying why."""
    if not records:
        return
    for r in tqdm(records, desc="chat template", unit="conv", disable=not progress, file=console_stream()):
        if r.regen and r.regen != "ok":
            r.status = f"failed: regeneration: {r.regen.removeprefix('failed: ')}"
            continue
        try:
            ids, mask = render_with_loss_mask(tokenizer, r.messages)
        except Exception as err:
            r.status = f"failed: chat template: {err}"
            continue
        r.status = length_status(ids, mask, cfg.data.min_tokens, max_len)
        if len(ids) > max_len:
            r.truncated_from = len(ids)
            ids, mask = ids[:max_len], mask[:max_len]
        r.num_tokens = len(ids)
        if r.status == "ok":  # compact tensors: Python int lists would cost ~10x the memory
            r.token_ids = torch.tensor(ids, dtype=torch.int32)
            r.loss_mask = torch.tensor(mask, dtype=torch.bool)


ANSWER_ROLES = ("assistant", COMPLETION_ROLES[1])  # what the target wrote, chat or completion


def report_health(records: list[Record], layout: DataLayout, cfg: PipelineConfig) -> None:
    """Measure the answers about to be trained on, save ``health.json``, warn (or, with
    ``data.strict_health``, refuse) before any state is extracted."""
    from peagle.data.health import Answer, check_health, measure_health, opening_of

    def answer(r: Record) -> Answer:
        first = next((m["content"] for m in r.messages if m.get("role") in ANSWER_ROLES), "")
        return Answer(r.token_ids.tolist(), r.loss_mask.tolist(), opening_of(first), r.finish_reasons)

    report = measure_health([answer(r) for r in records if r.status == "ok" and r.token_ids is not None])
    write_json_atomic(layout.health, report.to_dict(), indent=2)
    check_health(report, cfg.data.strict_health)


def length_status(ids: list[int], mask: list[bool], min_tokens: int, max_len: int) -> str:
    if len(ids) < min_tokens:
        return f"failed: too short ({len(ids)} tokens < data.min_tokens={min_tokens})"
    if not any(mask):
        return "failed: no assistant tokens to learn from"
    if not any(mask[:max_len]):
        return f"failed: no assistant tokens within the first {max_len} tokens (data.max_seq_len)"
    return "ok"


def failure_reasons(records: list[Record]) -> Counter:
    """Failure statuses grouped by kind (the part before any parenthesised detail)."""
    return Counter(r.status.split(" (")[0] for r in records if r.status != "ok")


def require_training_samples(records: list[Record]) -> None:
    if not any(r.split == "train" and r.status == "ok" for r in records):
        reasons = ", ".join(f"{n} x {why}" for why, n in failure_reasons(records).most_common(3))
        raise ConfigError(
            f"no training sample survived ({len(records)} prompts: {reasons}); check data.sources, "
            "data.min_tokens, data.max_seq_len and the target's chat template"
        )


# ----------------------------------------------------------------------------- summary


def dataset_info(data_dir: Path, config_hash: str, records: list[Record], prompt_files: dict[str, str]) -> DatasetInfo:
    layout = DataLayout(data_dir)
    manifests = {s: json.loads(layout.manifest(s).read_text()) for s in SPLITS}
    on_disk = sum(p.stat().st_size for p in data_dir.rglob("*") if p.is_file())
    return DatasetInfo(
        data_dir=data_dir,
        train_dir=layout.train,
        eval_dir=layout.eval,
        vocab_path=layout.vocab,
        facts_path=layout.facts,
        num_train=manifests["train"]["num_samples"],
        num_eval=manifests["eval"]["num_samples"],
        num_tokens=manifests["train"]["num_tokens"] + manifests["eval"]["num_tokens"],
        num_failed=sum(r.status != "ok" for r in records),
        bytes_on_disk=on_disk,
        config_hash=config_hash,
        prompt_files=prompt_files,
    )
