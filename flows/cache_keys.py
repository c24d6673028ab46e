"""Prefect's cache keys: what decides each cached stage output, with no machine-local path.

Cached results live in the run directory, shared by the CLI and a worker whose paths may
differ. A head's key is its identity (``peagle.identity.head_identity``), so the training
cache, the checkpoint directory and the lineage agree on when a head is the same.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from peagle.data.served import served_key
from peagle.fileio import json_digest, sha256_file
from peagle.layout import LINEAGE_FILE
from peagle.lineage import dataset_inputs, revision_of
from peagle.stages import HeadPlan


def _digest_parts(*parts) -> str:
    return json_digest([str(p) for p in parts], length=24)


WRITTEN_BY_THE_TARGET = "written by the target"


def dataset_key(cfg, target) -> str:
    """The dataset: target+data config, prompt-file contents, target revision (``target``: a
    ``peagle.stages.TargetInfo``), and what its served split is made of (``peagle.data.served``).

    A ``kind: magpie`` file counts by what writes it, its source's settings (in the data config)
    and the target, not by its content: the first run writes it after its key is taken, and the
    next run must find that run's dataset. The lineage still names the file by its content."""
    values = dataset_inputs(cfg, target)
    written = {src.path for src in cfg.data.sources if src.kind == "magpie"}
    files = {path: WRITTEN_BY_THE_TARGET if path in written else digest
             for path, digest in json.loads(values["prompt_files"]).items()}
    return "data-" + _digest_parts(values["data_config_hash"], json.dumps(files, sort_keys=True),
                                   values["target_revision"], served_key(cfg))


def training_key(plan: HeadPlan) -> str:
    """A trained head: its plan's identity (the dataset actually built, the weight-changing fields,
    the method), worked out once by ``peagle.stages.plan_head``."""
    return "train-" + plan.identity


def evaluation_key(cfg, target, heads: Mapping[str, str], head_key: str | None = None, champion=None) -> str:
    """Online acceptance: the heads (their training keys when known, else their files' hashes;
    the card and the lineage file do not count), the registry champion measured beside them
    (its content; ``peagle.publish.gate.ChampionHead``), the target, vLLM and eval settings."""
    from peagle.contract import CARD_FILE  # loads torch: not when a worker imports the flows

    head = head_key or {label: {p.name: sha256_file(p) for p in sorted(Path(d).glob("*"))
                                if p.is_file() and p.name not in (CARD_FILE, LINEAGE_FILE)}
                        for label, d in heads.items()}
    return "eval-" + _digest_parts(head, sorted(heads), champion and champion.content, revision_of(cfg, target),
                                   cfg.section_hash("vllm", "eval"), cfg.target.dtype)
