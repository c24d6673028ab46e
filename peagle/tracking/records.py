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


def record_online(run, online, out_dir: Path) -> Path:
    from peagle.eval.plots import plot_online

    for label in online.methods():
        run.log_metrics_per_k(online.acceptance_by_k(label), f"{label}_acceptance_length")
    for label in online.completion.methods() if online.completion else []:
        run.log_metrics_per_k(online.completion.acceptance_by_k(label), f"{label}_completion_acceptance_length")
    for r in online.rows:
        tag = "baseline" if r.k == 0 else f"{r.method}_k{r.k}"
        run.log_metrics({f"{tag}_c{r.concurrency}_output_tok_s": r.output_tokens_per_s})
    out_dir.mkdir(parents=True, exist_ok=True)
    png = plot_online(online, out_dir / ONLINE_PLOT_FILE)
    table = online.save(out_dir / ONLINE_RESULTS_FILE)
    run.log_artifact(png)
    run.log_artifact(table)
    return png
