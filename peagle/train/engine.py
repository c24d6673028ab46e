"""The DeepSpeed engine that trains the drafter: process group, config, optimizer, schedule.

Everything DeepSpeed needs comes from ``TrainConfig``: ZeRO stage 0-3, bf16 or fp32,
optional CPU optimizer offload, gradient accumulation and clipping, AdamW (or DeepSpeed's
Muon on the matrices, ``train.recipe.optimizer: muon``) and a linear warmup + linear decay
schedule. With AdamW nothing here needs a C++ compiler on a CPU machine (Muon's update
is torch.compiled: ``peagle.train.launch.check_optimizer_runs_here``):
AdamW runs as ``torch.optim.AdamW`` (``"torch_adam": true``, also with offload), and
DeepSpeed's shared-memory CPU comm op (compiled with g++ at init otherwise) is
switched off, so ranks talk over gloo. On GPUs the backend is nccl.

Sequence partitioning: with ``train.recipe.segments = S`` every micro-batch runs as S
forward+backward passes. DeepSpeed is told ``gradient_accumulation_steps =
grad_accum * S`` so it only steps (and reduces, clips, schedules) after the last
segment of the last micro-batch; the trainer scales each segment's loss itself.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass

import torch
from torch import nn

from peagle.config import TrainConfig

NO_DECAY_PARAMS = ("mask_hidden",)


@dataclass(frozen=True)
class DistInfo:
    rank: int  # global rank: which slice of the data, and who writes files (rank 0)
    local_rank: int  # rank on this host: which GPU
    world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def use_gpu() -> bool:
    return torch.cuda.is_available()


def flush_denormals() -> bool:
    """Treat subnormal floats as zero on this process's CPU threads (x86 FTZ/DAZ); False where
    the CPU cannot. Arithmetic that lands on subnormals takes a microcoded slow path, which a
    drafter's training on the CPU hits often; flushing them shortens it without changing what
    the head accepts. Set it in a process training owns, before its worker threads start
    (they inherit it): the rank's entry point."""
    return torch.set_flush_denormal(True)


def init_process_group() -> DistInfo:
    """Join the process group the launcher described (torchrun / deepspeed env vars).

    Run without a launcher, this process becomes a world of one. Idempotent: a second
    call returns the existing group.
    """
    defaults = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    if "MASTER_PORT" not in os.environ:
        defaults["MASTER_PORT"] = str(_free_port())
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    import deepspeed
    import torch.distributed as dist

    if not use_gpu():
        # Skips a g++ build of DeepSpeed's shared-memory comm op; gloo is as fast here.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    local_rank = int(os.environ["LOCAL_RANK"])
    if use_gpu():
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        _forget_stale_deepspeed_groups()
        deepspeed.init_distributed(dist_backend="nccl" if use_gpu() else "gloo", auto_mpi_discovery=False, verbose=False)
    return DistInfo(rank=dist.get_rank(), local_rank=local_rank, world_size=dist.get_world_size())


def _forget_stale_deepspeed_groups() -> None:
    """DeepSpeed caches clones of the world group it saw first. When another library in this
    process tore torch.distributed down (vLLM's engine shutdown does), those clones are stale
    and DeepSpeed's first broadcast fails with "Group ... is not registered": drop them."""
    from deepspeed.utils import groups

    release = getattr(groups, "_release_process_group_references", None)
    if release is not None:
        release()


def micro_steps_per_step(train: TrainConfig) -> int:
    """DeepSpeed micro-steps per optimizer step: every segment of every micro-batch is one."""
    return train.grad_accum * train.recipe.segments


def warmup_steps(train: TrainConfig, total_steps: int) -> int:
    return math.ceil(train.recipe.warmup_ratio * total_steps)


def deepspeed_config(train: TrainConfig, world_size: int) -> dict:
    """The DeepSpeed JSON config for ``train`` (see the module docstring for segments)."""
    gas = micro_steps_per_step(train)
    zero: dict = {"stage": train.launch.zero_stage}
    if train.launch.offload_optimizer:
        if train.launch.zero_stage == 0:
            raise ValueError("train.launch.offload_optimizer needs train.launch.zero_stage >= 1 (ZeRO owns the offload)")
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": use_gpu()}
    return {
        "train_micro_batch_size_per_gpu": train.recipe.micro_batch_size,
        "gradient_accumulation_steps": gas,
        "train_batch_size": train.recipe.micro_batch_size * gas * world_size,
        # DeepSpeed's ZeRO Muon writes its orthogonalized update into the gradient before
        # clipping, so clipping would cut Muon's step size (measured: to a tenth): Muon's
        # updates have a fixed size already, AdamW's half is scale-free.
        "gradient_clipping": train.recipe.grad_clip if train.recipe.optimizer == "adamw" else 0.0,
        "optimizer": optimizer_config(train),
        "zero_optimization": zero,
        "bf16": {"enabled": train.recipe.precision == "bf16"},
        "fp16": {"enabled": False},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def optimizer_config(train: TrainConfig) -> dict:
    """AdamW, or Muon: DeepSpeed tags the >= 2-D parameters outside the embeddings and lm_head
    for Muon (fc, attention, MLP; ``mask_hidden`` is a vector, so AdamW steps it)
    and steps the rest with AdamW at ``learning_rate``."""
    adamw = {"lr": train.recipe.learning_rate, "weight_decay": train.recipe.weight_decay, "torch_adam": True}
    if train.recipe.optimizer == "adamw":
        return {"type": "AdamW", "params": adamw}
    return {"type": "Muon", "params": {**adamw, "muon_lr": train.recipe.muon_learning_rate, "adam_lr": train.recipe.learning_rate,
                                        "momentum": 0.95}}


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: norms' gains, the mask_hidden vector and the mask token's own
    embedding row (``train.peagle.train_embeddings: mask_row``) are not shrunk."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        keep = p.dim() < 2 or name in NO_DECAY_PARAMS
        (no_decay if keep else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def warmup_decay(total_steps: int, warmup: int):
    """LR factor for optimizer step s: linear warmup to 1, then linear decay toward 0."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return factor


def build_engine(model: nn.Module, train: TrainConfig, total_steps: int, world_size: int, clock=None):
    """Wrap ``model`` in a DeepSpeed engine (optimizer and LR schedule included).

    The schedule is a torch ``LambdaLR`` stepped by DeepSpeed once per optimizer step, over
    ``total_steps`` or, given a ``peagle.train.budget.TrainingClock``, over its time budget;
    its state rides in DeepSpeed's checkpoint. DeepSpeed's checkpoint loader is replaced
    by one that never unpickles (``checkpoint.install_safe_loader``).
    """
    import deepspeed

    from peagle.train.checkpoint import install_safe_loader

    if clock is not None:
        from peagle.train.budget import time_warmup_decay

        factor = time_warmup_decay(clock, train.recipe.warmup_ratio, total_steps)
    else:
        factor = warmup_decay(total_steps, warmup_steps(train, total_steps))
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=parameter_groups(model, train.recipe.weight_decay),
        config=deepspeed_config(train, world_size),
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor),
    )
    install_safe_loader(engine)
    if engine.zero_optimization_partition_weights():
        keep_root_parameters_gathered(engine.module)
    return engine


def keep_root_parameters_gathered(model: nn.Module) -> None:
    """ZeRO-3: never re-partition the root module's own parameters (``mask_hidden``).

    ZeRO-3 re-gathers a module's parameters for backward through hooks on the module's
    output tensors; the drafter returns a dataclass, which the hooks cannot see, so a
    root-level parameter released after forward would be missing when its gradient
    arrives. It is one small vector (3 x Ht), so it simply stays gathered.
    """
    from deepspeed.runtime.zero.partition_parameters import register_external_parameter

    for param in model.parameters(recurse=False):
        register_external_parameter(model, param)
        param.is_external_param = True


def current_lr(engine) -> float:
    return float(engine.lr_scheduler.get_last_lr()[0])
