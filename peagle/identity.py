"""What identifies a trained head: the inputs that decide its weights, and nothing else.

A head is a function of three things: the dataset it is trained on (its split manifests,
which hash every shard and name the target and data config that built them), the config
fields that change its weights, and its drafting method. ``head_identity`` digests them.
Four places ask, and so agree:

- the Prefect training cache (``flows.cache_keys.training_key``): a cached head is reused
  exactly when its identity is unchanged;
- the checkpoint directory (``peagle.stages.checkpoint_dir``, ``checkpoints/<method>/<identity[:12]>``):
  the same inputs resume there, changed ones train a new head beside the old one;
- the trainer's resume check: a checkpoint directory continues only the run it began;
- the lineage retraining compares with the registered champion (``peagle.lineage.lineage``,
  ``train_config_hash``): retraining is decided before the dataset is rebuilt, so there
  the dataset is represented by what builds it (prompt files, target revision, data
  config) and the training part is ``training_hash``, the same digest as here.

What counts: the ``drafter`` section (the head's shape), ``train.recipe`` (what every head is
trained on and how), the method's own block of ``train`` (``train.peagle`` or ``train.eagle3``:
P-EAGLE's ``k_train`` means nothing to EAGLE-3) and the method; with the dataset, nothing else.
The rest of ``train`` is where and when, never what: ``launch`` (ranks, nodes, ZeRO, attention
kernels: a head trained on 2 ranks resumes on 1, ``peagle.train.checkpoint``), ``checkpoints``
(when they are written and scored, how many stay), ``baseline`` (a second head beside this one)
and ``init_from`` (a warm start reaches a head for the same inputs, so a head already trained or
registered on them is reused rather than retrained from another start; the start is recorded in
``train_result.json``). The EAGLE-3 baseline's ``same_time`` budget reaches its identity as the
``recipe.max_train_seconds`` it resolves to (``peagle.stages.method_config``): the seconds the
head's own steps took, which a cached head keeps, so an unchanged run retrains neither.
"""

from __future__ import annotations

from collections.abc import Mapping

from peagle.catalogue import describe
from peagle.fileio import json_digest, sha256_file
from peagle.layout import SPLITS, DataLayout


def training_fields(cfg, method: str | None = None) -> dict:
    """The config that decides a head's weights for the method named ``method`` (default ``train.method``)."""
    method = describe(method or cfg.train.method)
    return {"drafter": cfg.drafter.model_dump(mode="json"), "method": method.name,
            "recipe": cfg.train.recipe.model_dump(mode="json"),
            method.train_block: method.own(cfg.train).model_dump(mode="json")}


def training_hash(cfg, method: str | None = None) -> str:
    """Digest of ``training_fields``: the training half of a head's identity."""
    return json_digest(training_fields(cfg, method))


def head_identity(cfg, dataset: Mapping[str, str], method: str | None = None) -> str:
    """A head's identity: its dataset (``dataset_manifests``), ``training_hash`` and method."""
    return json_digest({"dataset": dict(dataset), "training": training_hash(cfg, method)})


def dataset_manifests(data_dir) -> dict[str, str]:
    """sha256 of each split's manifest.json: the identity of the dataset actually built."""
    data = DataLayout(data_dir)
    return {split: sha256_file(data.manifest(split)) for split in SPLITS if data.manifest(split).exists()}
