"""The pipeline's stages as plain functions with typed inputs and outputs.

Each stage calls one subpackage; the Prefect flows in ``flows/`` and the CLI both call
these, so every stage also runs from a test or a notebook without an orchestrator.
Stages pass small dataclasses (paths and numbers), never live engines. Beside them: the
model card (``peagle.export.card``), registration (``peagle.publish.promote``), what the
tracker logs (``peagle.publish.records``) and what a head is trained on (``peagle.lineage``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from peagle.catalogue import BASELINE, describe, trained_methods
from peagle.checkpoint_format import resolve_checkpoint
from peagle.config import INIT_FROM_CHAMPION, ConfigError, PipelineConfig, with_overrides
from peagle.contract import CONFIG_FILE, WEIGHTS_FILE
from peagle.data.parts import Part
from peagle.data.prompt_sets import check_eval_prompts, load_chat_prompt_sets, load_completion_prompts
from peagle.facts import HeadSpec, TargetFacts, drafter_shape, load_dataset_facts, target_facts_from_target
from peagle.identity import dataset_manifests, head_identity
from peagle.layout import BEST, METRICS_FILE, DataLayout, RunLayout
from peagle.train.gpu_hours import gpu_hours_line

log = logging.getLogger(__name__)


@dataclass
class TargetInfo:
    path: str
    facts: TargetFacts  # before the data stage: no draft vocabulary size yet
    revision: str | None = None  # peagle.lineage.target_revision: hub commit or local content hash
    revision_source: str = ""  # how the revision was found (for the logs)


@dataclass
class StageTimer:
    """Wall-clock seconds per stage, reported at the end of a run and logged to MLflow."""

    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def stage(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = round(time.perf_counter() - start, 1)


def prepare_target(cfg: PipelineConfig) -> TargetInfo:
    """Resolve (or build) the target and check the config against it before heavy work; tell its
    revision (what the lineage and cache keys name it by) once per run. The evaluation prompt
    files are checked first: a missing or short one fails before a target is built or downloaded."""
    from peagle.lineage import target_revision
    from peagle.target import resolve_target

    check_eval_prompts(cfg)
    path = resolve_target(cfg.target)
    facts, _ = checked_target_facts(cfg, path)
    revision = target_revision(cfg.target, path)
    return TargetInfo(path=path, facts=facts, revision=revision.value, revision_source=revision.source)


def checked_target_facts(cfg: PipelineConfig, path: str) -> tuple[TargetFacts, object]:
    """(the facts, the tokenizer) of the resolved target at ``path``, with the config checked against
    them: the mask token is one token of the tokenizer, the drafter and train sections fit."""
    from peagle.target import load_target_config_and_tokenizer

    target_config, tokenizer = load_target_config_and_tokenizer(cfg.target.model_copy(update={"model": path}))
    facts = target_facts_from_target(cfg, target_config, tokenizer)
    drafter_shape(cfg, facts)  # a drafter/train section that cannot work fails now, not after the data stage
    return facts, tokenizer


@dataclass
class ConfigReport:
    notes: list[str]  # what is left to the run (an embedded target not built yet, a source not read here)
    plan: list[str]  # what the dataset will cost (``peagle.data.budget``); empty before the target is built


def check_config(cfg: PipelineConfig) -> ConfigReport:
    """``peagle config check``: every check of ``cfg`` that needs no engine and downloads no
    weights, data or benchmark; a ``ConfigError`` naming the key and the fix at the first that
    fails. The target resolves (a local directory; a hub id in the cache when the hub is off; the
    embedded target once built) and the config fits it (``checked_target_facts``, the draft
    vocabulary); the data stage's own checks follow (``peagle.data.preflight``); then the
    dataset's cost on the run's disk, stored or streamed, a stored one that cannot fit refused
    (``peagle.data.budget``); for a GPU config, training's GPU hours (``peagle.train.gpu_hours``)."""
    from peagle.data.budget import data_budget, expected_samples
    from peagle.data.preflight import CONFIG_CHECK_PROMPTS, check_data_inputs, check_writable
    from peagle.target import resolve_target
    from peagle.target.embedded import BUILD_COMMAND, embedded_target_dir, is_complete

    notes, tokenizer, mask_token_id, facts = [], None, None, None
    if cfg.target.is_embedded and not is_complete(embedded_target_dir(cfg.target.embedded)):
        check_writable(embedded_target_dir(cfg.target.embedded), "PEAGLE_HOME")
        notes.append(f"target: the tiny test target is not built yet: `{BUILD_COMMAND}` builds it, in minutes, into "
                     f"{embedded_target_dir(cfg.target.embedded)}; the mask token is checked once it is built")
    else:
        facts, tokenizer = checked_target_facts(cfg, resolve_target(cfg.target))
        facts = facts.with_draft_vocab(cfg.data.draft_vocab_size or facts.vocab_size)
        mask_token_id = facts.mask_token_id
    inputs = check_data_inputs(cfg, tokenizer, mask_token_id, download=False, scan=CONFIG_CHECK_PROMPTS)
    plan = []
    if facts is not None:
        samples = expected_samples(cfg, len(inputs.prompts), inputs.unwritten, inputs.unread)
        budget = data_budget(cfg, len(facts.stored_layer_ids), facts.target_hidden_size, samples)
        budget.check_fits()
        plan = budget.lines()
        if cfg.train.recipe.precision == "bf16":  # a GPU config
            plan.append(gpu_hours_line(cfg, facts, budget.tokens(budget.train_samples)))
    return ConfigReport(notes=notes + inputs.notes(), plan=plan)


def check_training_runs_here(cfg: PipelineConfig) -> None:
    """What training needs of this machine, for a run that trains after its data stage: Muon (the
    default optimizer) on a CPU without a C++ compiler is refused now, not after the data."""
    from peagle.train.launch import check_optimizer_runs_here

    check_optimizer_runs_here(cfg.train)


def generate_data(cfg: PipelineConfig, target: TargetInfo, *, force: bool = False, repair: bool = False,
                  config_hint: str = "CONFIG"):
    """Prompts -> regenerated responses -> hidden states -> shards + draft vocabulary, and what
    built them (``data/lineage.json``, which export hands on to the head): the prompt sources
    as the build read them (a magpie file once written, a hub set at its commit). ``force``
    replaces a dataset of another configuration once the new one is complete; ``repair`` (and
    ``force``) extracts the samples of corrupt shards again (``peagle.data.pipeline``). Parts
    built on other hosts (``generate_data_part``) are taken in; ``config_hint`` names the config
    in the commands messages suggest."""
    from peagle.data.pipeline import build_dataset
    from peagle.lineage import dataset_inputs, record_dataset_inputs

    info = build_dataset(cfg, target.path, target.facts, progress=True, force=force, repair=repair,
                         target_revision=target.revision, config_hint=config_hint)
    record_dataset_inputs(info.data_dir, dataset_inputs(cfg, target, info.prompt_files))
    return info


def generate_data_part(cfg: PipelineConfig, target: TargetInfo, part: str, *, force: bool = False,
                       config_hint: str = "CONFIG"):
    """One host's part ``"I/N"`` of a data stage spread over hosts (``peagle.data.parts``); the
    build that follows (``generate_data``) takes every part in."""
    from peagle.data.pipeline import build_part

    return build_part(cfg, target.path, target.facts, Part.parse(part), force=force,
                      target_revision=target.revision, config_hint=config_hint)


def write_requests(cfg: PipelineConfig, target: TargetInfo, *, force: bool = False) -> int:
    """The config's Magpie requests written once, before a data stage's parts read them; the
    number of prompts the build mixes from."""
    from peagle.data.pipeline import write_requests as write

    return write(cfg, target.path, target.facts, force=force)


def dataset_on_disk(cfg: PipelineConfig) -> bool:
    """The run's data dir holds a finished build of this config (else a cached data result is stale)."""
    data = RunLayout(cfg.run_dir).data
    if not data.build.exists() or not data.vocab.exists() or not data.facts.exists():
        return False
    return json.loads(data.build.read_text()).get("config_hash") == cfg.section_hash("target", "data")


def with_train(cfg: PipelineConfig, changes: Mapping[str, Any]) -> PipelineConfig:
    """The same config with some ``train`` keys changed (dotted below ``train``:
    ``{"recipe.max_steps": None}``), validated as a config file is."""
    return with_overrides(cfg, {f"train.{key}": value for key, value in changes.items()})


def with_method(cfg: PipelineConfig, method: str) -> PipelineConfig:
    """The same config training the head of the method named ``method``."""
    return with_train(cfg, {"method": describe(method).name})


def method_config(cfg: PipelineConfig, method: str, data_dir: Path) -> PipelineConfig:
    """The config ``method``'s head trains with on ``data_dir``: ``with_method``, and for the
    EAGLE-3 baseline beside another head with ``train.baseline.budget: same_time`` a
    time budget (``train.recipe.max_train_seconds``) of the seconds that head's optimizer steps took, and
    no step cap: its steps are cheaper or dearer than the head's, and the time is what is shared.
    Everything that names a head (its checkpoint directory, training key, lineage) asks here."""
    resolved = with_method(cfg, method)
    head = cfg.train.method
    if method == head or method != BASELINE or cfg.train.baseline.budget != "same_time":
        return resolved
    return with_train(resolved, {"recipe.max_train_seconds": head_training_seconds(cfg, head, data_dir),
                                 "recipe.max_steps": None})


def head_training_seconds(cfg: PipelineConfig, method: str, data_dir: Path) -> float:
    """Seconds the optimizer steps of ``method``'s head on these inputs took (its ``metrics.jsonl``;
    checkpointing, evaluation and each process's first step not counted, as on a time budget's
    clock: ``peagle.train.budget``), to the millisecond."""
    metrics = checkpoint_dir(cfg, method, data_dir) / METRICS_FILE
    if not metrics.is_file():
        raise FileNotFoundError(
            f"train.baseline.budget is same_time: the EAGLE-3 baseline trains for as long as the "
            f"{describe(method).display_name} head did, and no such head has trained on these inputs ({metrics} "
            "is missing): train it first (`peagle train`), or set train.baseline.budget=same_steps")
    from peagle.train.budget import counted_seconds

    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return max(0.001, round(counted_seconds(records), 3))


def checkpoint_dir(cfg: PipelineConfig, method: str, data_dir: Path) -> Path:
    """Where ``method``'s head for these inputs trains: one directory per head identity
    (``peagle.identity``: the dataset, the weight-changing config, the method), so the same
    inputs resume and changed ones (a deeper drafter, a grown dataset) train a new head
    beside the old one, which stays usable."""
    resolved = method_config(cfg, method, data_dir)
    return RunLayout(resolved.run_dir).checkpoints(resolved.train.method, identity_of(resolved, data_dir))


def identity_of(resolved: PipelineConfig, data_dir: Path) -> str:
    """The identity of the head a config already resolved for it (``method_config``) trains on ``data_dir``."""
    return head_identity(resolved, dataset_manifests(data_dir), resolved.train.method)


def trained_checkpoint(cfg: PipelineConfig, method: str, data_dir: Path) -> Path:
    """The best step directory of the ``method`` head trained on these inputs (export's default);
    a clear error naming the heads this run did train when there is none."""
    best = checkpoint_dir(cfg, method, data_dir) / BEST
    if best.is_file():
        return resolve_checkpoint(best)
    root = RunLayout(cfg.run_dir).method_checkpoints(method)
    others = sorted(p.name for p in root.glob("*") if (p / BEST).is_file()) if root.is_dir() else []
    raise FileNotFoundError(
        f"no trained {describe(method).display_name} head for this config and dataset under {best.parent}"
        + (f" (this run holds others, trained on other inputs: {', '.join(others)})" if others else "")
        + ": run `peagle train` first, or pass --checkpoint DIR")


def resolve_init_from(cfg: PipelineConfig) -> PipelineConfig:
    """``train.init_from: champion`` -> the registry champion's head, downloaded into the run dir.

    The directory is named after the champion's version. Where training starts is not part
    of a head's identity (``peagle.identity``): a new champion alone retrains nothing. No
    champion yet (a first scheduled run): train from the target's weights, and say so.
    """
    if cfg.train.init_from != INIT_FROM_CHAMPION:
        return cfg
    from peagle.publish.pull import download_champion
    from peagle.publish.registry import champion_version
    from peagle.tracking.mlflow_run import make_client, registered_model_name, resolve_tracking_uri

    client = make_client(resolve_tracking_uri(cfg.tracking))
    name = registered_model_name(cfg.tracking, cfg.target.model)
    champion = champion_version(client, name)
    if champion is None:
        log.info("train.init_from: %r has no champion yet; training from the target's weights", name)
        head = None
    else:
        head = RunLayout(cfg.run_dir).warm_start(champion.version)
        if not (head / WEIGHTS_FILE).exists():
            download_champion(client, name, head, overwrite=True)
        head = str(head)
    return with_train(cfg, {"init_from": head})


@dataclass(frozen=True)
class HeadPlan:
    """One head's training, worked out once before any work (``plan_head``) and read by every
    later step of it: its method, the config it trains with (``method_config``: validated), the
    checked dataset it trains on, its identity (``peagle.identity``: what a resumed run must
    share, handed to the ranks) and its checkpoint directory (one per identity)."""

    method: str
    config: PipelineConfig
    data_dir: Path
    identity: str
    checkpoint_dir: Path


def plan_head(cfg: PipelineConfig, method: str | None, data_dir: Path) -> HeadPlan:
    """The ``HeadPlan`` of ``method``'s head (default ``train.method``) on ``data_dir``; refuses a
    missing, unfinished or corrupt dataset, and an EAGLE-3 baseline timed by a head not trained
    yet, each with its fix, before a target is resolved or a champion downloaded."""
    from peagle.data.check import check_dataset

    check_dataset(data_dir)
    resolved = method_config(cfg, method or cfg.train.method, Path(data_dir))
    method, identity = resolved.train.method, identity_of(resolved, Path(data_dir))
    return HeadPlan(method, resolved, Path(data_dir), identity, RunLayout(resolved.run_dir).checkpoints(method, identity))


def train_head(plan: HeadPlan, target: TargetInfo, *, mlflow_run_id: str | None = None):
    """Train ``plan``'s drafter with DeepSpeed in its own launcher processes; resumes if interrupted.

    Checkpoints are chosen by offline acceptance (``peagle.eval.offline``: the served split, decoded
    as vLLM does), not by loss. With
    ``mlflow_run_id`` (the stage's MLflow run) rank 0's step metrics reach it while the ranks run.
    """
    from peagle.rank import RANK_MODULE
    from peagle.train.launch import launch_training

    on_metrics = None
    if mlflow_run_id:
        from peagle.tracking.mlflow_run import stage_run

        on_metrics = stage_run(plan.config.tracking, mlflow_run_id).log_step_records
    return launch_training(
        resolve_init_from(plan.config),
        plan.data_dir,
        target.path,
        plan.checkpoint_dir,
        rank_module=RANK_MODULE,
        dataset_checked=True,  # plan_head checked it
        head_identity=plan.identity,
        on_metrics=on_metrics,
    )


def require_separate_producer(cfg: PipelineConfig) -> None:
    """A producer extracts only for a training that does not extract beside its own ranks."""
    if cfg.data.producer != "separate":
        raise ConfigError("data.producer is launcher: `peagle train` extracts beside its own ranks. Set "
                          "data.producer: separate (in the config, or --set data.producer=separate, for both the "
                          "training and the producer) to extract on another host instead")


def produce_hidden_states(plan: HeadPlan, target: TargetInfo, training_ended=None) -> bool:
    """``data.producer: separate``: extract ``plan``'s streamed train split into its spool, on
    this host's engines, for ``train_head`` running on other hosts, until that training ends
    (``peagle.train.launch.produce_separately``); whether it finished."""
    from peagle.train.launch import produce_separately

    return produce_separately(plan.config, plan.data_dir, target.path, plan.checkpoint_dir, training_ended)


def evaluate_offline(cfg: PipelineConfig, target: TargetInfo, data_dir: Path, checkpoint: Path, *,
                     method: str | None = None):
    """Simulated acceptance per K of a checkpoint (``peagle.eval.offline``: on the served split, as
    vLLM decodes the eval prompts, else the held-out split), at the K its
    method can be evaluated at. The drafter's shape, method and k_train are the checkpoint's."""
    from peagle.data.store import ShardReader
    from peagle.data.vocab import DraftVocab
    from peagle.eval.offline import evaluable_ks, offline_split
    from peagle.eval.offline import evaluate_offline as run_offline
    from peagle.model import PEagleDrafter

    data = DataLayout(data_dir)
    drafter = PEagleDrafter.from_checkpoint(checkpoint).eval()
    spec = drafter.spec
    check_trained_on(spec, data, checkpoint)
    method = method or spec.method or cfg.train.method
    vocab = DraftVocab.load(data.vocab)
    ks, limit = evaluable_ks(cfg.eval.ks, describe(method).max_eval_k(spec))  # the K it trained for
    split, max_tokens = offline_split(data.root)
    return run_offline(drafter, None, ShardReader(split), spec, vocab, ks, cfg.eval.offline_max_samples, method,
                       max_k=limit, max_tokens=max_tokens, split=split.name, mask_slot_inputs=spec.mask_slot_inputs)


def check_trained_on(spec: HeadSpec, data: DataLayout, checkpoint: Path) -> None:
    """Refuse a checkpoint trained on another dataset's target, layers or draft vocabulary."""
    if not spec.same_target_as(load_dataset_facts(data)):
        raise ValueError(
            f"{checkpoint} was trained on another dataset than {data.root} (target, layers or draft "
            "vocabulary differ); pass the data dir it was trained on"
        )


def exported_head_dir(cfg: PipelineConfig, method: str) -> Path:
    """Where the run exports the head of the method named ``method``."""
    return RunLayout(cfg.run_dir).head(describe(method).name)


def export_head(cfg: PipelineConfig, target: TargetInfo, data_dir: Path, checkpoint: Path,
                *, method: str | None = None, card=None) -> Path:
    """Write the vLLM head directory of a ``method`` checkpoint (default ``train.method``) with the
    lineage it provably was trained on (``peagle.lineage``) and a card naming the target's hub id and
    license (``peagle.target.metadata``); refuses a head that fails validation."""
    from peagle.export.card import ModelCardInfo
    from peagle.export.head import export_from_checkpoint
    from peagle.lineage import write_head_lineage
    from peagle.target.metadata import target_metadata

    method = method or cfg.train.method
    card = replace(card or ModelCardInfo(), target=target_metadata(cfg, target.path))
    head = export_from_checkpoint(Path(checkpoint), Path(data_dir), exported_head_dir(cfg, method), card,
                                  target_path=target.path, overwrite=True, method=method)
    write_head_lineage(head, method_config(cfg, method, Path(data_dir)), data_dir, checkpoint, method)
    return head


def heads_to_evaluate(cfg: PipelineConfig, head_dir: str | Path | None = None,
                      baseline_dir: str | Path | None = None) -> dict[str, str]:
    """Method name -> exported head directory for an online evaluation; refuses a missing head.

    ``head_dir``: the ``train.method`` head (default the run's ``heads/<method>``);
    ``baseline_dir``: the EAGLE-3 baseline trained on the same data (default the run's
    ``heads/eagle3`` when ``train.baseline.eagle3``).
    """
    head, *baseline = trained_methods(cfg.train)
    if not baseline and baseline_dir is not None and head.name != BASELINE:
        baseline = [describe(BASELINE)]
    heads = {head.name: str(head_dir or exported_head_dir(cfg, head.name))}
    heads |= {m.name: str(baseline_dir or exported_head_dir(cfg, m.name)) for m in baseline}
    for name, directory in heads.items():
        if not (Path(directory) / CONFIG_FILE).exists():
            raise FileNotFoundError(f"no exported {describe(name).display_name} head at {directory}: "
                                    f"run the train flow first (method {name})")
    return heads


def load_eval_prompts(cfg: PipelineConfig) -> list[list[dict]]:
    from peagle.data.prompt_sets import load_eval_prompts as load

    return load(cfg)


def evaluate_online(cfg: PipelineConfig, target: TargetInfo, heads: dict[str, Path], champion=None):
    """Acceptance per K and output tokens/s in vLLM of each method's head (rows keyed by the
    method's label, drafting as the method does) on every prompt set of ``eval.prompts``, against
    no speculation and vLLM's n-gram lookup at the same K; the
    registry's champion (a ``peagle.publish.gate.ChampionHead``) in the same run when given,
    its rows labelled ``champion-v<N>``, so the gate compares like with like: at the largest K,
    the only K the gate reads (``peagle.publish.gate.head_score``), one engine."""
    from peagle.eval.online import evaluate_online as run_online

    methods = {describe(m).label: m for m in heads}
    paths = {describe(m).label: Path(d) for m, d in heads.items()}
    if champion is not None:
        methods[champion.label], paths[champion.label] = champion.method, Path(champion.head_dir)
    (first_set, first_prompts), *more_sets = load_chat_prompt_sets(cfg).items()
    return run_online(
        target.path,
        paths,
        cfg.vllm,
        first_prompts,
        ks=cfg.eval.ks,
        concurrency=cfg.eval.concurrency,
        max_tokens=cfg.eval.max_tokens,
        methods=methods,
        prompt_set=first_set,
        more_prompt_sets=dict(more_sets),
        target_revision=cfg.target.revision,
        trust_remote_code=cfg.target.trust_remote_code,
        dtype=cfg.target.dtype,
        completion_prompts=load_completion_prompts(cfg),
        completion_prompt_set=Path(cfg.eval.completion_prompts).stem if cfg.eval.completion_prompts else "",
        largest_k_only=[champion.label] if champion is not None else [],  # the gate compares there
    )



def summary_json(obj) -> str:
    """A stage result as the CLI prints it."""
    return json.dumps(asdict(obj) if hasattr(obj, "__dataclass_fields__") else obj, indent=2, default=str)
