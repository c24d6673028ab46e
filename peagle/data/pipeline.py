"""The data stage: prompts -> target responses -> hidden states -> shards + draft vocabulary.

``build_dataset`` writes ``<run>/data/`` (format in docs/design.md, "Dataset"):

1. load and mix the prompt sources, hold out ``data.heldout_samples`` for evaluation;
   refuse a mask token the prompts contain (``peagle.data.mask_token``);
2. regenerate every assistant turn with the target (vLLM), persisted to
   ``samples.jsonl`` as each batch finishes, so a rerun never regenerates twice;
3. render each conversation with the target's chat template + assistant loss mask,
   drop sequences shorter than ``data.min_tokens`` and TRUNCATE longer ones to
   ``data.max_seq_len`` (recorded per sample as ``truncated_from``); refuse a mask token
   the rendered samples contain (the chat template's, or the target's answers);
4. print the disk the hidden states will take and refuse when it is not free;
5. extract the hidden states of ``facts.stored_layer_ids`` (same vLLM engine) into
   train/eval shards; samples already in a shard are skipped on a rerun; then the
   served split (``peagle.data.served``: the eval prompts as vLLM decodes them, what
   offline acceptance is simulated on);
6. build the draft vocabulary from the TRAIN split's supervised tokens and save
   ``vocab.safetensors``, ``target_facts.json`` and the final ``samples.jsonl``.

The dataset owns the target's facts only; the drafter's shape is the checkpoint's
(``peagle.facts``), so changing the ``drafter`` section never needs new data.

The config hash (``target`` + ``data`` sections) is stored in ``build.json`` and every
manifest: a rerun with a different configuration refuses unless ``force`` (which
rebuilds from scratch).
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
from peagle.data.chat import render_with_loss_mask
from peagle.data.prompts import Conversation, load_prompts, split_heldout
from peagle.data.served import build_served_split, served_is_current
from peagle.data.store import ShardReader, ShardWriter, check_free_space, estimate_bytes, format_bytes
from peagle.data.vocab import build_draft_vocab, count_tokens
from peagle.facts import TargetFacts
from peagle.fileio import atomic_open, write_json_atomic
from peagle.layout import SAMPLES_FILE, SPLITS, DataLayout, RunLayout
from peagle.logs import console_stream

log = logging.getLogger(__name__)


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


@dataclass
class Record:
    """One prompt's journey; a line of samples.jsonl."""

    id: str
    split: str
    source: str
    messages: list[dict]
    regen: str | None = None  # None: not regenerated; "ok"; or "failed: reason"
    status: str = "ok"  # "ok" or "failed: reason"
    num_tokens: int | None = None
    truncated_from: int | None = None
    finish_reasons: list[str] = field(default_factory=list)
    token_ids: torch.Tensor | None = field(default=None, repr=False)  # int32, in memory only
    loss_mask: torch.Tensor | None = field(default=None, repr=False)  # bool

    def line(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("token_ids", "loss_mask")}
        return {k: v for k, v in d.items() if v is not None and v != []}


def build_dataset(
    cfg: PipelineConfig, target_path: str, facts: TargetFacts, progress: bool = True, force: bool = False
) -> DatasetInfo:
    """Build (or finish building) the dataset of ``cfg`` for the target at ``target_path``."""
    from transformers import AutoTokenizer

    from peagle.eval.prompts import check_eval_prompts

    check_eval_prompts(cfg)  # the served split and the evaluate stage read them
    layout = RunLayout(cfg.run_dir).data
    data_dir = layout.root
    config_hash = cfg.section_hash("target", "data")
    draft_vocab_size = cfg.data.draft_vocab_size or facts.vocab_size
    final_facts = facts.with_draft_vocab(draft_vocab_size)  # ConfigError now rather than after extraction
    prepare_data_dir(data_dir, config_hash, force)
    tokenizer = AutoTokenizer.from_pretrained(
        target_path, revision=cfg.target.revision, trust_remote_code=cfg.target.trust_remote_code
    )

    records = plan_records(cfg, data_dir)
    mask_token.check_prompts(records, tokenizer, cfg.target, facts.mask_token_id)  # before any engine starts
    max_len = min(cfg.data.max_seq_len, cfg.vllm.max_model_len - 1)  # extraction needs one spare position
    meta = {"config_hash": config_hash, "target": cfg.target.model, "target_revision": cfg.target.revision}
    with ExitStack() as stack:
        writers = {
            split: stack.enter_context(ShardWriter(
                layout.split(split), facts.stored_layer_ids, facts.target_hidden_size,
                cfg.data.storage_dtype, cfg.data.shard_max_tokens, meta,
            ))
            for split in SPLITS
        }
        engine = _LazyEngine(stack, cfg, target_path, facts, layout.work)
        pending_regen = [r for r in records if cfg.data.regenerate.enabled and r.regen is None]
        if pending_regen:
            with engine.for_regeneration() as llm:
                regenerate(llm, tokenizer, pending_regen, cfg, layout.samples, progress)
        render_records(tokenizer, records, cfg, max_len, progress)
        require_training_samples(records)
        mask_token.check_samples(records, tokenizer, cfg.target, facts.mask_token_id)  # the answers too
        todo = [r for r in records if r.status == "ok" and r.id not in writers[r.split].done_ids()]
        check_disk(todo, facts, cfg, data_dir, force)
        if todo:
            extract_into(engine.get(), todo, writers, cfg, progress)
        if not served_is_current(cfg, layout):
            build_served_split(engine.get(), tokenizer, cfg, layout, facts.stored_layer_ids,
                               facts.target_hidden_size, meta)
    write_samples(layout.samples, records)

    vocab = build_draft_vocab(count_tokens(ShardReader(layout.train, verify=False), facts.vocab_size),
                              draft_vocab_size)
    vocab.save(layout.vocab)
    final_facts.save(layout.facts)
    layout.legacy_head_spec.unlink(missing_ok=True)  # an older peagle's, with a stale drafter shape
    info = dataset_info(data_dir, config_hash, records)
    log.info(
        f"data: {info.num_train} train + {info.num_eval} eval samples, {info.num_tokens} tokens, "
        f"{info.num_failed} failed, {format_bytes(info.bytes_on_disk)} in {data_dir}"
    )
    for reason, count in failure_reasons(records).most_common(5):
        log.info(f"  {count} x {reason}")
    return info


# ----------------------------------------------------------------------------- run directory


def prepare_data_dir(data_dir: Path, config_hash: str, force: bool) -> None:
    """Refuse to mix configurations: a different config hash needs ``force`` (then rebuild)."""
    layout = DataLayout(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    build = layout.build
    old = json.loads(build.read_text())["config_hash"] if build.exists() else None
    for split in SPLITS:
        manifest = layout.manifest(split)
        if old is None and manifest.exists():
            old = json.loads(manifest.read_text()).get("config_hash")
    if old is not None and old != config_hash:
        if not force:
            raise ConfigError(
                f"{data_dir} holds a dataset built with another configuration (config hash {old}, now "
                f"{config_hash}: the target or data section changed); rerun with --force to rebuild it, "
                "or give this run another name/workdir"
            )
        log.info(f"data: config changed ({old} -> {config_hash}), --force: rebuilding {data_dir}")
        for path in (layout.splits_dir, layout.work, layout.samples, layout.vocab, layout.facts,
                     layout.legacy_head_spec, layout.build):
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    write_json_atomic(build, {"config_hash": config_hash}, indent=None)


def plan_records(cfg: PipelineConfig, data_dir: Path) -> list[Record]:
    """Every prompt as a Record, with regenerated responses of an earlier run restored."""
    prompts = load_prompts(cfg.data, verbose=True)
    previous = read_samples(DataLayout(data_dir).samples)
    splits = {sample_id: rec.get("split") for sample_id, rec in previous.items()}
    train, heldout = split_heldout(prompts, cfg.data.heldout_samples, cfg.data.seed, splits)
    records = []
    for split, convs in (("train", train), ("eval", heldout)):
        for conv in convs:
            records.append(_record(conv, split, previous.get(conv.id), cfg.data.regenerate.enabled))
    restored = sum(r.regen is not None for r in records)
    log.info(
        f"data: {len(train)} train + {len(heldout)} held-out prompts"
        + (f"; {restored} regenerated responses restored from {SAMPLES_FILE}" if restored else "")
    )
    return records


def _record(conv: Conversation, split: str, previous: dict | None, regenerate_enabled: bool) -> Record:
    if regenerate_enabled and previous and previous.get("regen") and previous.get("split") == split:
        return Record(conv.id, split, conv.source, previous["messages"], regen=previous["regen"],
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

            replicas = self.cfg.vllm.data_parallel_size
            log.info(f"data: starting vLLM for {self.target_path}"
                     + (f" ({replicas} engine replicas)" if replicas > 1 else ""))
            t = self.cfg.target
            self.llm = self.stack.enter_context(open_data_engine(
                self.target_path, self.cfg.vllm, self.facts.stored_layer_ids, self.work_dir,
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


def regenerate(llm, tokenizer, records: list[Record], cfg: PipelineConfig, samples_path: Path, progress: bool) -> None:
    """Target-written assistant turns, saved batch by batch so a crash loses one batch at most."""
    from peagle.data.regenerate import regenerate_responses

    rcfg = cfg.data.regenerate
    chunk = 4 * rcfg.batch_size
    bar = tqdm(total=len(records), desc="regenerate", unit="conv", disable=not progress, file=console_stream())
    for start in range(0, len(records), chunk):
        batch = records[start : start + chunk]
        results = regenerate_responses(llm, tokenizer, [r.messages for r in batch], rcfg, progress=False,
                                       seed=cfg.data.seed)
        for r, res in zip(batch, results, strict=True):
            r.messages = res.messages
            r.regen = "ok" if res.error is None else f"failed: {res.error}"
            r.finish_reasons = list(res.finish_reasons)
        append_samples(samples_path, batch)
        bar.update(len(batch))
    bar.close()


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


def check_disk(todo: list[Record], facts: TargetFacts, cfg: PipelineConfig, data_dir: Path, force: bool) -> None:
    tokens = sum(r.num_tokens for r in todo)
    nl, ht = len(facts.stored_layer_ids), facts.target_hidden_size
    needed = estimate_bytes(tokens, nl, ht, cfg.data.storage_dtype) if todo else 0
    truncated = sum(r.truncated_from is not None for r in todo)
    free = check_free_space(data_dir, needed, force)
    log.info(
        f"data: {len(todo)} sequences ({tokens} tokens, {truncated} truncated to {cfg.data.max_seq_len}) to "
        f"extract: {format_bytes(needed)} on disk ({nl} layers x {ht} x {cfg.data.storage_dtype}); "
        f"{format_bytes(free)} free"
    )


# ----------------------------------------------------------------------------- summary


def dataset_info(data_dir: Path, config_hash: str, records: list[Record]) -> DatasetInfo:
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
    )
