"""A built dataset as MLflow datasets: what the data stage made and what training read.

Each split (train, eval) is one ``mlflow.data`` dataset, logged as an input of the data
stage run (context ``output``: it built it) and of each training run (the train split as
``training``, the held-out split that picks the best checkpoint as ``evaluation``). Its
digest is the split manifest's sha256 (the first ``DIGEST_CHARS``; the whole hash, which
``peagle.identity`` and the lineage tags use, is in the profile), its source the split's
directory, its profile what the manifest says: samples, tokens, bytes, shards, storage
dtype, layers, and the prompt files it was built from. The shards themselves are not
uploaded: MLflow records what was used, the run directory holds it.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from mlflow.data import Dataset
from mlflow.data.dataset_source_registry import resolve_dataset_source

from peagle.identity import dataset_manifests
from peagle.layout import DataLayout

DIGEST_CHARS = 16  # as long as peagle's other short digests; MLflow holds at most 36
BUILT, TRAINING, EVALUATION = "output", "training", "evaluation"
TRAINING_CONTEXTS = {"train": TRAINING, "eval": EVALUATION}  # split -> context on a training run


class SplitDataset(Dataset):
    """One split of a built dataset, described by its manifest (nothing is loaded)."""

    def __init__(self, split_dir: Path, name: str, manifest: dict, manifest_sha256: str,
                 prompt_files: dict[str, str]):
        self._profile = {
            "samples": manifest["num_samples"],
            "tokens": manifest["num_tokens"],
            "bytes": manifest["bytes"],
            "shards": len(manifest["shards"]),
            "storage_dtype": manifest["storage_dtype"],
            "layer_ids": manifest["layer_ids"],
            "hidden_size": manifest["hidden_size"],
            "target": manifest.get("target"),
            "config_hash": manifest.get("config_hash"),
            "manifest_sha256": manifest_sha256,
            "prompt_files": prompt_files,
        }
        with warnings.catch_warnings():  # MLflow registers two local-file sources; both are the same class
            warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
            source = resolve_dataset_source(str(Path(split_dir).resolve()))
        super().__init__(source=source, name=name, digest=manifest_sha256[:DIGEST_CHARS])

    def _compute_digest(self) -> str:
        return self._profile["manifest_sha256"][:DIGEST_CHARS]

    @property
    def profile(self) -> dict:
        return self._profile

    @property
    def schema(self) -> None:
        return None  # hidden states in bfloat16/float8 have no MLflow column or tensor type

    def to_dict(self) -> dict[str, str]:
        return {**super().to_dict(), "profile": json.dumps(self._profile)}


def built_datasets(data_dir: str | Path, name: str, prompt_files: dict[str, str]) -> dict[str, SplitDataset]:
    """``{split: SplitDataset}`` for each finished split of the dataset at ``data_dir``, named
    ``<name>-<split>``; ``prompt_files`` maps each source prompt file to its sha256."""
    data = DataLayout(data_dir)
    digests = dataset_manifests(data_dir)
    return {
        split: SplitDataset(data.split(split), f"{name}-{split}", json.loads(data.manifest(split).read_text()),
                            digest, prompt_files)
        for split, digest in digests.items()
    }


def log_datasets(run, datasets: dict[str, SplitDataset], contexts: dict[str, str] | str) -> None:
    """Log ``datasets`` as inputs of ``run`` (a ``RunLogger``), each with its context."""
    for split, dataset in datasets.items():
        run.log_input(dataset, contexts if isinstance(contexts, str) else contexts[split])
