"""Where a run's files live: the one place that spells the run and dataset directory layouts.

::

    <run>/                              RunLayout(cfg.run_dir)
      data/                             DataLayout: the dataset (docs/design.md, "Dataset")
        build.json  samples.jsonl  target_facts.json  vocab.safetensors  lineage.json  work/
        splits/<train|eval|served>/manifest.json, shard-NNNNN.safetensors
      data.rebuild-<config hash>/       a dataset of another configuration being built (--force);
                                        it replaces data/ once complete
      checkpoints/<method>/<identity>/  one head's training (peagle.identity, first 12 hex digits):
                                        launch_config.json, metrics.jsonl, train_result.json, latest, best
        spool/                          a streamed dataset's hidden states while this head trains
                                        (peagle.data.spool)
        step-NNNNNN/                    drafter.safetensors, head_spec.json, trainer_state.json
      heads/<method>/                   the exported head (config.json, model.safetensors, README.md, lineage.json)
      eval/                             online_results.json, online_acceptance.png
      warm_start/v<N>/                  a downloaded registry champion (train.init_from: champion)
      champion/v<N>/                    the registry champion, served beside the head by the evaluate stage
      revisions/<lineage key>/          a retraining revision: a run directory of its own
      config.resolved.json              the config the run's stage subflows load
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Dataset files.
BUILD_FILE = "build.json"
SAMPLES_FILE = "samples.jsonl"
TARGET_FACTS_FILE = "target_facts.json"
HEALTH_FILE = "health.json"
VOCAB_FILE = "vocab.safetensors"
MANIFEST_FILE = "manifest.json"
# What a dataset was built from, and (in a head directory) what a head was trained on (peagle.lineage).
LINEAGE_FILE = "lineage.json"
PART_FILE = "part.json"  # written last by a finished part of the data stage (peagle.data.parts)
SPLITS = ("train", "eval")
TRAIN_SPLIT, EVAL_SPLIT = SPLITS

# Checkpoint files (peagle.train.checkpoint writes them).
DRAFTER_FILE = "drafter.safetensors"
HEAD_SPEC_FILE = "head_spec.json"
TRAINER_STATE_FILE = "trainer_state.json"
# Pointers to a step directory, beside the step directories (peagle.train.checkpoint).
LATEST = "latest"
BEST = "best"  # the step with the best offline acceptance
# Beside the step directories of a method's checkpoint root (peagle.train.launch / trainer).
LAUNCH_CONFIG_FILE = "launch_config.json"
METRICS_FILE = "metrics.jsonl"
TRAIN_RESULT_FILE = "train_result.json"
SPOOL_DIR = "spool"


def spool_dir(checkpoints: str | Path) -> Path:
    """Where a head trained on a streamed dataset gets its hidden states (``peagle.data.spool``)."""
    return Path(checkpoints) / SPOOL_DIR

RESOLVED_CONFIG_FILE = "config.resolved.json"
# <run>/data.rebuild-<config hash>/: a dataset of another configuration being built (--force)
REBUILD_PREFIX = "data.rebuild-"

IDENTITY_CHARS = 12  # of a head identity, naming its checkpoint directory

# Online evaluation outputs.
ONLINE_RESULTS_FILE = "online_results.json"
ONLINE_PLOT_FILE = "online_acceptance.png"


@dataclass(frozen=True)
class DataLayout:
    """A dataset directory."""

    root: Path

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))

    @property
    def build(self) -> Path:
        return self.root / BUILD_FILE

    @property
    def samples(self) -> Path:
        return self.root / SAMPLES_FILE

    @property
    def facts(self) -> Path:
        return self.root / TARGET_FACTS_FILE

    @property
    def vocab(self) -> Path:
        return self.root / VOCAB_FILE

    @property
    def health(self) -> Path:
        """The target's answers measured for diversity and repetition (``peagle.data.health``)."""
        return self.root / HEALTH_FILE

    @property
    def lineage(self) -> Path:
        """The inputs the dataset was built from (prompt files, target revision, data config)."""
        return self.root / LINEAGE_FILE

    @property
    def work(self) -> Path:
        """Scratch space of the extraction engine."""
        return self.root / "work"

    @property
    def parts_dir(self) -> Path:
        """Where the parts of a data stage spread over hosts are built (``peagle.data.parts``)."""
        return self.root / "parts"

    def part(self, label: str) -> DataLayout:
        return DataLayout(self.parts_dir / label)

    @property
    def part_done(self) -> Path:
        """In a part's own layout: written once the part is complete."""
        return self.root / PART_FILE

    @property
    def splits_dir(self) -> Path:
        return self.root / "splits"

    def split(self, name: str) -> Path:
        return self.splits_dir / name

    def manifest(self, split: str) -> Path:
        return self.split(split) / MANIFEST_FILE

    @property
    def train(self) -> Path:
        return self.split(TRAIN_SPLIT)

    @property
    def eval(self) -> Path:
        return self.split(EVAL_SPLIT)


@dataclass(frozen=True)
class CheckpointLayout:
    """One checkpoint step directory."""

    root: Path

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))

    @property
    def drafter(self) -> Path:
        return self.root / DRAFTER_FILE

    @property
    def head_spec(self) -> Path:
        return self.root / HEAD_SPEC_FILE

    @property
    def trainer_state(self) -> Path:
        return self.root / TRAINER_STATE_FILE


@dataclass(frozen=True)
class RunLayout:
    """A run directory (``cfg.run_dir``)."""

    root: Path

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))

    @property
    def data(self) -> DataLayout:
        return DataLayout(self.root / "data")

    def data_rebuild(self, config_hash: str) -> DataLayout:
        """Where ``peagle data --force`` builds a dataset of another configuration: beside
        ``data/``, which stays whole until the new one is complete and takes its place."""
        return DataLayout(self.root / f"{REBUILD_PREFIX}{config_hash}")

    def data_rebuilds(self) -> list[DataLayout]:
        """Every unfinished rebuild in this run directory."""
        return [DataLayout(p) for p in sorted(self.root.glob(f"{REBUILD_PREFIX}*")) if p.is_dir()]

    def method_checkpoints(self, method: str) -> Path:
        """Every ``method`` head trained in this run, one directory per head identity."""
        return self.root / "checkpoints" / method

    def checkpoints(self, method: str, identity: str) -> Path:
        """Where the trainer of the ``method`` head with ``identity`` (``peagle.identity.head_identity``)
        writes ``step-*`` directories and the latest/best pointers."""
        return self.method_checkpoints(method) / identity[:IDENTITY_CHARS]

    @property
    def heads(self) -> Path:
        return self.root / "heads"

    def head(self, method: str) -> Path:
        return self.heads / method

    @property
    def eval(self) -> Path:
        return self.root / "eval"

    @property
    def online_results(self) -> Path:
        return self.eval / ONLINE_RESULTS_FILE

    @property
    def online_plot(self) -> Path:
        return self.eval / ONLINE_PLOT_FILE

    @property
    def library_log(self) -> Path:
        """Where vLLM's, DeepSpeed's, torch's and transformers' output goes while a stage runs
        (``peagle.logs.library_output_to``), so our own lines stay readable on the console."""
        return self.root / "logs" / "libraries.log"

    @property
    def resolved_config(self) -> Path:
        """The run's config with overrides applied (``peagle.config.write_resolved_config``)."""
        return self.root / RESOLVED_CONFIG_FILE

    def warm_start(self, version: str | int) -> Path:
        """A registry champion's head downloaded for ``train.init_from: champion``."""
        return self.root / "warm_start" / f"v{version}"

    def champion(self, version: str | int) -> Path:
        """The registry champion's head, downloaded to be measured beside this run's head."""
        return self.root / "champion" / f"v{version}"

    def revision(self, key: str) -> Path:
        """The run directory of a retraining revision (``flows/retrain.py``)."""
        return self.root / "revisions" / key
