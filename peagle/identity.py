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

What counts: the whole ``drafter`` section (the head's shape), every ``train`` field except
the bookkeeping below and the fields only another drafting method reads (its
``own_train_fields``: P-EAGLE's ``k_train``/``cod_*`` mean nothing to EAGLE-3, and
``eagle3_ttt_steps`` nothing to P-EAGLE), and the method. A new ``train`` field counts
until it is listed here: a stale head is worse than a retrain.

Bookkeeping, which never counts (``BOOKKEEPING``):
- ``keep_last``: how many checkpoints stay on disk.
- ``save_every``: when checkpoints are written; every step's weights are the same.
- ``eval_every``: when checkpoints are scored offline; it decides which of them is
  "best", not what any of them holds, and can change on resume.
- ``eagle3_baseline``: asks the pipeline for a second head beside this one.
- ``eagle3_baseline_budget``: how long that head trains; ``same_time`` reaches its identity as
  the ``max_train_seconds`` it resolves to (``peagle.stages.method_config``): the seconds the
  head's own steps took, which a cached head keeps, so an unchanged run retrains neither.
- ``init_from``: where training starts, not what it learns from: a warm start reaches a
  head for the same inputs, so a head already trained (or registered) on them is reused
  rather than retrained from another start; the start is recorded in
  ``train_result.json`` (``warm_start``).
- ``attention``: which kernels evaluate the attention rule (flex attention's block-sparse mask
  or a dense mask), not the rule: both give the same outputs and gradients
  (``tests/model/test_flex_attention.py``), so a run may switch between them on resume.
- ``nodes``, ``rdzv_endpoint``, ``rdzv_id``, ``rdzv_timeout_s``, ``hostfile``, ``devices``: where
  the ranks run, not what they compute.
``world_size`` and ``grad_accum`` count as their product (``micro_batches_per_step``): with
``micro_batch_size`` it sets the global batch, and step s trains the same samples however
it splits into ranks x accumulation (``peagle.train.data``), so a head trained on 2 ranks
resumes on 1 with twice the accumulation (``peagle.train.checkpoint``).
"""

from __future__ import annotations

from collections.abc import Mapping

from peagle.catalogue import DESCRIPTIONS, describe
from peagle.fileio import json_digest, sha256_file
from peagle.layout import SPLITS, DataLayout

BOOKKEEPING = frozenset({"keep_last", "save_every", "eval_every", "eagle3_baseline", "eagle3_baseline_budget",
                         "init_from", "attention"})
LAUNCH = frozenset({"nodes", "rdzv_endpoint", "rdzv_id", "rdzv_timeout_s", "hostfile", "devices"})
SPLIT_OF_THE_BATCH = frozenset({"world_size", "grad_accum"})  # count as micro_batches_per_step


def training_fields(cfg, method: str | None = None) -> dict:
    """The config that decides a head's weights for the method named ``method`` (default ``train.method``)."""
    method = describe(method or cfg.train.method)
    others = {f for d in DESCRIPTIONS.values() for f in d.own_train_fields}
    ignored = BOOKKEEPING | LAUNCH | SPLIT_OF_THE_BATCH | (others - method.own_train_fields)
    train = {k: v for k, v in cfg.train.model_dump(mode="json").items() if k not in ignored}
    if cfg.train.optimizer != "muon":
        del train["muon_learning_rate"]  # read by Muon alone
    train["micro_batches_per_step"] = cfg.train.micro_batches_per_step
    train["method"] = method.name
    return {"drafter": cfg.drafter.model_dump(mode="json"), "train": train}


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
