"""The pipeline's stages as plain functions with typed inputs and outputs.

Each stage calls one subpackage; the Prefect flows in ``flows/`` and the CLI both call
these, so every stage also runs from a test or a notebook without an orchestrator.
Stages pass small dataclasses (paths and numbers), never live engines. The ``record_*``
functions turn stage results into the values the tracker logs.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from peagle.config import INIT_FROM_CHAMPION, PipelineConfig
from peagle.facts import HeadSpec, TargetFacts, drafter_shape, target_facts_from_target
from peagle.fileio import sha256_file as file_digest
from peagle.layout import ONLINE_PLOT_FILE, ONLINE_RESULTS_FILE, SPLITS, CheckpointLayout, DataLayout, RunLayout
from peagle.methods import DraftingMethod, get_method, trained_methods

Method = str | DraftingMethod  # a drafting method's name or object (peagle.methods)
log = logging.getLogger(__name__)


@dataclass
class TargetInfo:
    path: str
    facts: TargetFacts  # before the data stage: no draft vocabulary size yet


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


# ----------------------------------------------------------------------------- stages


def prepare_target(cfg: PipelineConfig) -> TargetInfo:
    """Resolve (or build) the target and check the config against it before heavy work."""
    from peagle.target import load_target_config_and_tokenizer, resolve_target

    path = resolve_target(cfg.target)
    target_config, tokenizer = load_target_config_and_tokenizer(cfg.target.model_copy(update={"model": path}))
    facts = target_facts_from_target(cfg, target_config, tokenizer)
    drafter_shape(cfg, facts)  # a drafter/train section that cannot work fails now, not after the data stage
    return TargetInfo(path=path, facts=facts)


def generate_data(cfg: PipelineConfig, target: TargetInfo, *, force: bool = False):
    """Prompts -> regenerated responses -> hidden states -> shards + draft vocabulary."""
    from peagle.data.pipeline import build_dataset

    return build_dataset(cfg, target.path, target.facts, progress=True, force=force)


def with_train(cfg: PipelineConfig, **changes) -> PipelineConfig:
    """The same config with some ``train`` fields changed."""
    return cfg.model_copy(update={"train": cfg.train.model_copy(update=changes)})


def with_method(cfg: PipelineConfig, method: Method) -> PipelineConfig:
    """The same config training ``method``'s head."""
    return with_train(cfg, method=get_method(method).name)


def checkpoint_dir(cfg: PipelineConfig, method: Method) -> Path:
    return RunLayout(cfg.run_dir).checkpoints(get_method(method).name)


def resolve_init_from(cfg: PipelineConfig) -> PipelineConfig:
    """``train.init_from: champion`` -> the registry champion's head, downloaded into the run dir.

    The directory is named after the champion's version. Where training starts is not part
    of a head's identity (``peagle.identity``): a new champion alone retrains nothing. No
    champion yet (a first scheduled run): train from the target's weights, and say so.
    """
    if cfg.train.init_from != INIT_FROM_CHAMPION:
        return cfg
    from peagle.tracking.mlflow_run import make_client, registered_model_name, resolve_tracking_uri
    from peagle.tracking.registry import champion_version, download_champion

    client = make_client(resolve_tracking_uri(cfg.tracking))
    name = registered_model_name(cfg.tracking, cfg.target.model)
    champion = champion_version(client, name)
    if champion is None:
        log.info("train.init_from: %r has no champion yet; training from the target's weights", name)
        head = None
    else:
        head = RunLayout(cfg.run_dir).warm_start(champion.version)
        if not (head / "model.safetensors").exists():
            download_champion(client, name, head, overwrite=True)
        head = str(head)
    return with_train(cfg, init_from=head)


def train_head(cfg: PipelineConfig, target: TargetInfo, data_dir: Path, *, method: Method | None = None,
               mlflow_run_id: str | None = None):
    """Train a drafter with DeepSpeed in its own launcher processes; resumes if interrupted.

    Checkpoints are chosen by offline acceptance on the held-out split, not by loss. With
    ``mlflow_run_id`` (the stage's MLflow run) rank 0's step metrics reach it while the ranks run.
    """
    from peagle.train.launch import launch_training

    method = method or cfg.train.method
    on_metrics = None
    if mlflow_run_id:
        from peagle.tracking.mlflow_run import stage_run

        on_metrics = stage_run(cfg.tracking, mlflow_run_id).log_step_records
    return launch_training(
        with_method(resolve_init_from(cfg), method),
        Path(data_dir),
        target.path,
        checkpoint_dir(cfg, method),
        eval_factory="peagle.eval.offline:offline_eval_fn",
        on_metrics=on_metrics,
    )


def evaluate_offline(cfg: PipelineConfig, target: TargetInfo, data_dir: Path, checkpoint: Path, *,
                     method: Method | None = None):
    """Simulated acceptance per K of a checkpoint on the held-out hidden states, at the K its
    method can be evaluated at. The drafter's shape, method and k_train are the checkpoint's."""
    from peagle.data.store import ShardReader
    from peagle.data.vocab import DraftVocab
    from peagle.eval.offline import evaluable_ks
    from peagle.eval.offline import evaluate_offline as run_offline
    from peagle.model import PEagleDrafter

    data = DataLayout(data_dir)
    drafter = PEagleDrafter.from_checkpoint(checkpoint).eval()
    spec = drafter.spec
    check_trained_on(spec, data, checkpoint)
    method = get_method(method or spec.method or cfg.train.method)
    vocab = DraftVocab.load(data.vocab)
    k_train = spec.k_train or cfg.train.k_train  # a checkpoint of an older peagle does not record it
    ks, limit = evaluable_ks(with_train(cfg, k_train=k_train), method)
    reader = ShardReader(data.eval)
    return run_offline(drafter, None, reader, spec, vocab, ks, cfg.eval.offline_max_samples, method, max_k=limit)


def check_trained_on(spec: HeadSpec, data: DataLayout, checkpoint: Path) -> None:
    """Refuse a checkpoint trained on another dataset's target, layers or draft vocabulary."""
    from peagle.facts import load_dataset_facts

    if not spec.same_target_as(load_dataset_facts(data)):
        raise ValueError(
            f"{checkpoint} was trained on another dataset than {data.root} (target, layers or draft "
            "vocabulary differ); pass the data dir it was trained on"
        )


def exported_head_dir(cfg: PipelineConfig, method: Method) -> Path:
    """Where the run exports ``method``'s head."""
    return RunLayout(cfg.run_dir).head(get_method(method).name)


def export_head(cfg: PipelineConfig, target: TargetInfo, data_dir: Path, checkpoint: Path,
                *, method: Method | None = None, card=None) -> Path:
    """Write the vLLM head directory of a ``method`` checkpoint (default ``train.method``);
    refuses a head that fails validation."""
    from peagle.export.head import export_from_checkpoint

    method = get_method(method or cfg.train.method)
    return export_from_checkpoint(Path(checkpoint), Path(data_dir), exported_head_dir(cfg, method), card,
                                  target_path=target.path, overwrite=True, method=method)


def load_eval_prompts(cfg: PipelineConfig) -> list[list[dict]]:
    from peagle.config import resolve_repo_path
    from peagle.eval.online import load_prompt_set

    prompts = cfg.eval.prompts
    path = resolve_repo_path(prompts)
    return load_prompt_set(str(path) if path.exists() else prompts, cfg.eval.num_prompts)


def evaluate_online(cfg: PipelineConfig, target: TargetInfo, heads: dict[Method, Path]):
    """Acceptance per K and output tokens/s in vLLM of each method's head (rows keyed by the
    method's label, drafting as the method does), against the no-speculation baseline."""
    from peagle.eval.online import evaluate_online as run_online

    methods = {get_method(m).label: get_method(m) for m in heads}
    return run_online(
        target.path,
        {get_method(m).label: Path(d) for m, d in heads.items()},
        cfg.vllm,
        load_eval_prompts(cfg),
        ks=cfg.eval.ks,
        concurrency=cfg.eval.concurrency,
        max_tokens=cfg.eval.max_tokens,
        methods=methods,
        prompt_set=Path(cfg.eval.prompts).stem,
        target_revision=cfg.target.revision,
        trust_remote_code=cfg.target.trust_remote_code,
        dtype=cfg.target.dtype,
    )


def model_card(cfg: PipelineConfig, target: TargetInfo, data, online, offline, *, method: Method | None = None) -> object:
    """The card of ``method``'s head (default ``train.method``): lineage, training, acceptance
    per K, and beside it the other head the run trained (the EAGLE-3 baseline or its sibling)."""
    from peagle.export.card import ModelCardInfo

    method = get_method(method or cfg.train.method)
    primary = method is get_method(cfg.train.method)
    other = next((m for m in trained_methods(cfg.train) if m is not method and m.label in online.methods()), None)
    return ModelCardInfo(
        name=f"peagle-{cfg.name}" + ("" if primary else f"-{method.name}"),
        data_lineage={
            "prompts": ", ".join(s.path for s in cfg.data.sources),
            "samples (train/eval)": f"{data.num_train}/{data.num_eval}",
            "tokens": str(data.num_tokens),
            "config hash": data.config_hash,
            "regenerated by target": str(cfg.data.regenerate.enabled),
        },
        training={
            **method.card_training(cfg.train),
            "epochs": str(cfg.train.epochs),
            "offline acceptance (simulated on held-out states; vLLM's is below)": json.dumps({k: round(v, 3) for k, v in offline.acceptance_length.items()}),
        },
        acceptance=online.acceptance_by_k(method.label),
        baseline_label=other.display_name if other else "",
        baseline_acceptance=online.acceptance_by_k(other.label) if other else {},
        acceptance_source=f"vLLM, prompt set {online.prompt_set}, max_tokens {online.max_tokens}, greedy",
        method=method.name,
    )


def write_card(head_dir: Path, card, checkpoint: Path) -> None:
    """Rewrite the head's README.md once online acceptance is known (atomic).

    The architecture it states is the checkpoint's the head was exported from.
    """
    from peagle.export.card import render_model_card

    spec = HeadSpec.load(CheckpointLayout(checkpoint).head_spec)
    path = Path(head_dir) / "README.md"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(render_model_card(card, spec))
    tmp.replace(path)


def drafted(online, label: str) -> bool:
    """The head loaded in vLLM and proposed draft tokens at every K (the serving check)."""
    rows = [r for r in online.rows if r.method == label]
    return bool(rows) and all(r.num_draft_tokens > 0 for r in rows)


def promotion_score(cfg: PipelineConfig, online) -> float:
    """Weighted acceptance length of the ``train.method`` head at the largest evaluated K over
    the configured benchmarks."""
    from peagle.tracking.registry import weighted_score

    acceptance = online.acceptance_by_k(get_method(cfg.train.method).label)
    value = acceptance[max(acceptance)] if acceptance else 0.0
    benchmarks = {name: value for name in cfg.tracking.benchmark_weights}
    return weighted_score(benchmarks, cfg.tracking.benchmark_weights)


def publish_head(cfg: PipelineConfig, tracker, head_dir: Path, online, *, validated: bool):
    """Register the ``train.method`` head as a model version (alias challenger); promote it only if it wins."""
    from peagle.tracking.mlflow_run import registered_model_name
    from peagle.tracking.registry import TAG_TARGET, promote_if_better, register_head

    method = get_method(cfg.train.method)
    name = registered_model_name(cfg.tracking, cfg.target.model)
    score = promotion_score(cfg, online)
    acceptance = online.acceptance_by_k(method.label)
    version = register_head(
        tracker, tracker.run_id, head_dir, name,
        tags={TAG_TARGET: cfg.target.model, "K": str(max(cfg.eval.ks)), "validated": str(validated),
              "method": method.label, "config": cfg.name},
        metrics={"score": score, **{f"acceptance_length_k{k}": v for k, v in acceptance.items()}},
    )
    decision = promote_if_better(tracker, name, version.version, score, cfg.tracking.promotion_margin, validated)
    return version, decision


# ----------------------------------------------------------------------------- what the tracker logs


def record_dataset(tracker, run, data, prompt_files: dict[str, str]):
    """Dataset sizes on the stage run; manifest hashes (lineage) on the pipeline run; the
    splits as MLflow datasets the stage built (returned, for the training runs)."""
    from peagle.tracking.datasets import BUILT, built_datasets, log_datasets

    run.log_metrics({"num_train": data.num_train, "num_eval": data.num_eval, "num_tokens": data.num_tokens,
                     "num_failed": data.num_failed, "bytes_on_disk": data.bytes_on_disk})
    for split in SPLITS:
        manifest = DataLayout(data.data_dir).manifest(split)
        if manifest.exists():
            tracker.set_data_manifest(manifest, split=split)
    datasets = built_datasets(data.data_dir, tracker.run_name or "dataset", prompt_files)
    log_datasets(run, datasets, BUILT)
    return datasets


def record_training_inputs(run, datasets) -> None:
    """The dataset splits a training reads, logged before it starts (a watcher sees them)."""
    from peagle.tracking.datasets import TRAINING_CONTEXTS, log_datasets

    log_datasets(run, datasets, TRAINING_CONTEXTS)


def record_training(run, trained) -> None:
    """A training's step metrics: streamed while it ran, so only the steps that did not reach
    the run then (a cached training: all of them, at their original times) are sent now."""
    run.log_step_records(trained.metrics_history)


def record_offline(run, offline) -> None:
    run.log_metrics_per_k(offline.acceptance_length, "offline_acceptance_length")
    run.log_metrics({f"offline_accept_pos{i + 1}": p for i, p in enumerate(offline.per_position)})


def record_online(run, online, out_dir: Path) -> Path:
    from peagle.eval.plots import plot_online

    for label in online.methods():
        run.log_metrics_per_k(online.acceptance_by_k(label), f"{label}_acceptance_length")
    for r in online.rows:
        tag = "baseline" if r.k == 0 else f"{r.method}_k{r.k}"
        run.log_metrics({f"{tag}_c{r.concurrency}_output_tok_s": r.output_tokens_per_s})
    out_dir.mkdir(parents=True, exist_ok=True)
    png = plot_online(online, out_dir / ONLINE_PLOT_FILE)
    table = online.save(out_dir / ONLINE_RESULTS_FILE)
    run.log_artifact(png)
    run.log_artifact(table)
    return png


def summary_json(obj) -> str:
    return json.dumps(asdict(obj) if hasattr(obj, "__dataclass_fields__") else obj, indent=2, default=str)


# ----------------------------------------------------------------------------- lineage (what a head was trained on)

LINEAGE_PREFIX = "peagle.lineage."


def prompt_file_hashes(cfg: PipelineConfig) -> dict[str, str]:
    """sha256 of every local prompt file (a grown file is new prompt data); hub sets by name."""
    from peagle.config import resolve_repo_path

    hashes = {}
    for src in cfg.data.sources:
        path = resolve_repo_path(src.path)
        if src.kind == "hf" or not path.exists():
            hashes[src.path] = f"hub:{src.path}@{src.split}/{src.subset or ''}"
        elif path.is_dir():
            hashes[src.path] = _digest_strings(f"{p.relative_to(path)}:{file_digest(p)}"
                                               for p in sorted(path.rglob("*")) if p.is_file())
        else:
            hashes[src.path] = file_digest(path)
    return hashes


def target_revision(cfg: PipelineConfig, target: TargetInfo) -> str:
    """The configured revision, else a digest of the resolved target's config and weight files
    (and the directory's name, never its absolute path: the CLI and a worker may differ)."""
    if cfg.target.revision:
        return cfg.target.revision
    root = Path(target.path)
    parts = [root.resolve().name]
    if (root / "config.json").exists():
        parts.append(file_digest(root / "config.json"))
    parts += [f"{p.name}:{p.stat().st_size}" for p in sorted(root.glob("*.safetensors"))]
    return "local:" + _digest_strings(parts)[:16]


def _digest_strings(parts) -> str:
    import hashlib

    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def lineage(cfg: PipelineConfig, target: TargetInfo) -> dict[str, str]:
    """What a head is trained on, known before any work: the keys retraining compares.

    The dataset is named by what builds it (it is not built yet); the training part is the
    head identity's own (``peagle.identity.training_hash``: bookkeeping never counts).
    """
    from peagle.identity import training_hash

    return {
        "data_config_hash": cfg.section_hash("target", "data"),
        "train_config_hash": training_hash(cfg),
        "target_revision": target_revision(cfg, target),
        "prompt_files": json.dumps(prompt_file_hashes(cfg), sort_keys=True),
    }


def lineage_key(values: dict[str, str]) -> str:
    """One short digest of a lineage: names a retraining revision's directory."""
    return _digest_strings(f"{k}={values[k]}" for k in sorted(values))[:12]


def changes_since(recorded: dict[str, str], current: dict[str, str]) -> list[str]:
    """Human-readable differences between a head's recorded lineage and the current inputs."""
    if not recorded:
        return ["the champion has no recorded lineage (trained before lineage tags existed)"]
    changes = []
    old_files = json.loads(recorded.get("prompt_files", "{}"))
    new_files = json.loads(current["prompt_files"])
    for path in sorted(set(old_files) | set(new_files)):
        if path not in old_files:
            changes.append(f"new prompt source {path}")
        elif path not in new_files:
            changes.append(f"prompt source {path} removed")
        elif old_files[path] != new_files[path]:
            changes.append(f"prompt file {path} changed (new prompt data)")
    for key, what in (("target_revision", "target revision"), ("data_config_hash", "data/target config"),
                      ("train_config_hash", "drafter/train config or method")):
        if recorded.get(key) != current[key]:
            changes.append(f"{what} changed ({recorded.get(key)} -> {current[key]})")
    return changes


def recorded_lineage(version) -> dict[str, str]:
    """The lineage tags of a registered model version (empty when it has none)."""
    if version is None:
        return {}
    return {k.removeprefix(LINEAGE_PREFIX): v for k, v in version.tags.items() if k.startswith(LINEAGE_PREFIX)}


def tag_lineage(tracker, name: str, version: str, values: dict[str, str]) -> None:
    """Write a head's lineage on its registered version, where retraining reads it back."""
    for key, value in values.items():
        tracker.client.set_model_version_tag(name, str(version), LINEAGE_PREFIX + key, value)
