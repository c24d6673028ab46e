"""What the tracker logs for each stage: stage results turned into MLflow metrics and artifacts."""

from __future__ import annotations

from pathlib import Path

from peagle.layout import ONLINE_PLOT_FILE, ONLINE_RESULTS_FILE, SPLITS, DataLayout


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
    """One prompt set's acceptance per K for every head and n-gram lookup (vLLM's acceptance length
    and tokens per target step), and each head's gain over n-gram lookup (tokens per step and output
    tokens/s ratios): above 1, it earns its training."""
    from peagle.contract import NGRAM

    name = measured.prompt_set
    for label in measured.methods():
        run.log_metrics_per_k(measured.acceptance_by_k(label), f"{name}_{label}_acceptance_length")
        run.log_metrics_per_k(measured.tokens_per_step_by_k(label), f"{name}_{label}_tokens_per_step")
    floor = measured.tokens_per_step_by_k(NGRAM)  # n-gram lookup drafts on some steps only
    for label in measured.heads():
        gains = {k: t / floor[k] for k, t in measured.tokens_per_step_by_k(label).items() if floor.get(k)}
        run.log_metrics_per_k(gains, f"{name}_{label}_tokens_per_step_over_ngram")
    for r in measured.rows:
        if (ratio := measured.over_ngram(r)) is not None:
            run.log_metrics({f"{name}_{r.method}_k{r.k}_c{r.concurrency}_tok_s_over_ngram": ratio})


def record_online(run, online, out_dir: Path) -> Path:
    from peagle.eval.plots import plot_online

    for label in online.methods():  # the first prompt set: what the gate reads
        run.log_metrics_per_k(online.acceptance_by_k(label), f"{label}_acceptance_length")
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
