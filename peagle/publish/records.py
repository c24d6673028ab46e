"""What the tracker logs for each stage: stage results turned into MLflow metrics and artifacts."""

from __future__ import annotations

from pathlib import Path

from peagle.contract import NGRAM
from peagle.layout import ONLINE_PLOT_FILE, ONLINE_RESULTS_FILE, SPLITS, DataLayout

# vLLM's acceptance length (1 + accepted / drafts over the steps that drafted) in metric names: for
# a head it is its tokens per step, for n-gram lookup no per-step figure.
VLLM_ACCEPTANCE_LENGTH = "vllm_acceptance_length"


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


def record_prompt_set(run, measured) -> None:
    """One prompt set's figures per K for every head and n-gram lookup, named for what they are:
    ``<set>_<label>_tokens_per_step`` (what heads and n-gram lookup are compared on; n-gram
    lookup's least beside it, ``<set>_ngram_min_tokens_per_step``), ``<set>_<label>_vllm_acceptance_length``
    (vLLM's, over the steps that drafted only), and each head's gain over n-gram lookup (tokens
    per step and output tokens/s ratios): above 1, it earns its training."""
    name = measured.prompt_set
    for label in measured.methods():
        run.log_metrics_per_k(measured.tokens_per_step_by_k(label), f"{name}_{label}_tokens_per_step")
        run.log_metrics_per_k(measured.acceptance_by_k(label), f"{name}_{label}_{VLLM_ACCEPTANCE_LENGTH}")
    run.log_metrics_per_k(measured.min_tokens_per_step_by_k(NGRAM), f"{name}_{NGRAM}_min_tokens_per_step")
    floor = measured.tokens_per_step_by_k(NGRAM)  # n-gram lookup drafts on some steps only
    for label in measured.heads():
        gains = {k: t / floor[k] for k, t in measured.tokens_per_step_by_k(label).items() if floor.get(k)}
        run.log_metrics_per_k(gains, f"{name}_{label}_tokens_per_step_over_ngram")
    for r in measured.rows:
        if (ratio := measured.over_ngram(r)) is not None:
            run.log_metrics({f"{name}_{r.method}_k{r.k}_c{r.concurrency}_tok_s_over_ngram": ratio})


def record_online(run, online, out_dir: Path) -> Path:
    """Every prompt set's figures (``record_prompt_set``), the first set's also without its name
    (``<label>_tokens_per_step``, ``ngram_min_tokens_per_step``, ``<label>_vllm_acceptance_length``), output tokens/s per method,
    K and concurrency, and the plot and the results table as artifacts."""
    from peagle.eval.plots import plot_online

    for label in online.methods():
        run.log_metrics_per_k(online.tokens_per_step_by_k(label), f"{label}_tokens_per_step")
        run.log_metrics_per_k(online.acceptance_by_k(label), f"{label}_{VLLM_ACCEPTANCE_LENGTH}")
    run.log_metrics_per_k(online.min_tokens_per_step_by_k(NGRAM), f"{NGRAM}_min_tokens_per_step")
    for r in online.rows:
        tag = "baseline" if r.k == 0 else f"{r.method}_k{r.k}"
        run.log_metrics({f"{tag}_c{r.concurrency}_output_tok_s": r.output_tokens_per_s})
    for measured in online.prompt_sets():
        record_prompt_set(run, measured)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = plot_online(online, out_dir / ONLINE_PLOT_FILE)
    table = online.save(out_dir / ONLINE_RESULTS_FILE)
    run.log_artifact(png)
    run.log_artifact(table)
    return png
