"""The pipeline's stages as plain functions with typed inputs and outputs.

Each stage calls exactly one subpackage; the Prefect flows in ``flows/`` and the CLI
both call these, so every stage also runs from a test or a notebook without an
orchestrator. Stages pass small dataclasses (paths and numbers), never live engines.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from peagle.config import PipelineConfig, resolve_repo_path
from peagle.facts import HeadSpec, head_spec_from_target
from peagle.paths import configure_environment


@dataclass
class TargetInfo:
    path: str
    spec: HeadSpec


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
    """Resolve (or build) the target and check the config against it before heavy work."""
    configure_environment()
    from peagle.target import load_target_config_and_tokenizer, resolve_target

    path = resolve_target(cfg.target)
    target_config, tokenizer = load_target_config_and_tokenizer(cfg.target.model_copy(update={"model": path}))
    spec = head_spec_from_target(cfg, target_config, tokenizer)
    return TargetInfo(path=path, spec=spec)


def generate_data(cfg: PipelineConfig, target: TargetInfo, *, force: bool = False):
    """Prompts -> regenerated responses -> hidden states -> shards + draft vocabulary."""
    configure_environment()
    from peagle.data.pipeline import build_dataset

    return build_dataset(cfg, target.path, target.spec, progress=True, force=force)


def train_head(cfg: PipelineConfig, target: TargetInfo, data_dir: Path, *, method: str | None = None):
    """Train a drafter with DeepSpeed (in its own launcher process) on the dataset."""
    configure_environment()
    from peagle.train.launch import launch_training

    method = method or cfg.train.method
    run_cfg = cfg if method == cfg.train.method else cfg.model_copy(
        update={"train": cfg.train.model_copy(update={"method": method})}
    )
    out_dir = cfg.run_dir / "checkpoints" / method
    return launch_training(run_cfg, Path(data_dir), target.path, out_dir)


def export_head(cfg: PipelineConfig, target: TargetInfo, data_dir: Path, checkpoint_dir: Path,
                *, method: str = "peagle", card=None) -> Path:
    """Write the vLLM head directory from a checkpoint and validate it statically."""
    configure_environment()
    from peagle.export.head import export_from_checkpoint
    from peagle.export.validate import validate_head

    out_dir = cfg.run_dir / "heads" / method
    head_dir = export_from_checkpoint(Path(checkpoint_dir), Path(data_dir), out_dir, card)
    validate_head(head_dir, target.path, vllm_cfg=cfg.vllm, load_in_vllm=False)
    return head_dir


def load_eval_prompts(cfg: PipelineConfig) -> list[list[dict]]:
    """The user turns of the configured evaluation prompt set (chat messages)."""
    path = resolve_repo_path(cfg.eval.prompts)
    conversations = []
    with path.open() as fh:
        for line in fh:
            if line.strip():
                messages = json.loads(line)["messages"]
                conversations.append([m for m in messages if m["role"] != "assistant"][:1])
    return conversations[: cfg.eval.num_prompts]


def evaluate_online(cfg: PipelineConfig, target: TargetInfo, heads: dict[str, Path]):
    """Acceptance per K and output tokens/s in vLLM, against the no-speculation baseline."""
    configure_environment()
    from peagle.eval.online import evaluate_online as run_online

    return run_online(
        target.path,
        heads,
        cfg.vllm,
        prompts=load_eval_prompts(cfg),
        ks=cfg.eval.ks,
        concurrency=cfg.eval.concurrency,
        max_tokens=cfg.eval.max_tokens,
    )


def summary_json(obj) -> str:
    return json.dumps(asdict(obj) if hasattr(obj, "__dataclass_fields__") else obj, indent=2, default=str)
