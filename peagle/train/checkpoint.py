"""Drafter checkpoints written and resumed: atomic, resumable, pruned to the last N plus the best.
The directory's format, as the other stages read it, is ``peagle.checkpoint_format``.

``<root>/step-NNNNNN/`` holds

    drafter.safetensors   the drafter's state dict (vLLM head names), gathered on rank 0
    head_spec.json        the HeadSpec it was trained for: target facts, drafter shape,
                          method and k_train, so every later stage reads the head from here
    trainer_state.json    step, epoch, position in the epoch, batch plan, metrics, the
                          acceptance it was chosen by, and rank 0's python/numpy/torch RNG
                          states as plain lists (ranks > 0: rng-rank-R.json)
    deepspeed/engine/     DeepSpeed's own engine checkpoint (module, optimizer, scheduler),
                          partitioned for the world size that wrote it
    optimizer.safetensors the same state consolidated, free of any world size: per
                          parameter name its fp32 weights and optimizer state (AdamW's
                          moments, or Muon's momentum for the matrices Muon trains), with
                          AdamW's step, LR schedule and DeepSpeed's counters as metadata

A checkpoint is written into ``<root>/.tmp-step-NNNNNN`` and renamed when every rank
has finished, so a visible ``step-*`` directory is always complete; ``latest`` and
``best`` are small pointer files replaced atomically after the rename.

DeepSpeed saves its engine state with ``torch.save`` and its stock loader calls
``torch.load(weights_only=False)``, i.e. full unpickling. ``install_safe_loader`` swaps
in a loader that uses ``weights_only=True`` with only the three DeepSpeed classes its
ZeRO optimizer states contain allow-listed, so resuming never runs arbitrary pickle code.

A resume at the world size and ZeRO stage that wrote the checkpoint loads DeepSpeed's engine
checkpoint (bit-exact). At another world size (a node lost, or added: ``train.recipe.batch_size``
stays, each rank accumulates its share) or another ``train.launch.zero_stage``, ZeRO's partitions
no longer fit, so the engine is rebuilt from ``optimizer.safetensors`` through DeepSpeed's documented
full-state accessors (``deepspeed.utils.safe_set_full_fp32_param`` /
``safe_set_full_optimizer_state``), which cut each rank's fragment from the full tensors.
ZeRO 0-2 can; ZeRO-3 resumes only at its own world size.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from peagle.checkpoint_format import (
    TMP_PREFIX,
    TrainerState,
    best_acceptance,
    best_checkpoint,
    checkpoint_name,
    list_checkpoints,
    read_trainer_state,
    write_pointer,
)
from peagle.facts import HeadSpec
from peagle.fileio import is_temp_name, publish_dir
from peagle.layout import BEST, DRAFTER_FILE, HEAD_SPEC_FILE, LATEST, TRAINER_STATE_FILE

DEEPSPEED_DIR = "deepspeed"
DEEPSPEED_TAG = "engine"
OPTIMIZER_FILE = "optimizer.safetensors"
ADAMW_STATE = ("exp_avg", "exp_avg_sq")  # AdamW's per-parameter state besides its step count
MUON_STATE = ("momentum_buffer",)  # Muon's (train.recipe.optimizer: muon), on the matrices it trains


# ----------------------------------------------------------------------------- DeepSpeed loading


def _deepspeed_safe_globals() -> list:
    """The only non-tensor classes DeepSpeed 0.19's ZeRO 0-3 checkpoints contain (measured)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def install_safe_loader(engine) -> None:
    """Make ``engine.load_checkpoint`` read files with ``torch.load(weights_only=True)``."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location=None):
            with torch.serialization.safe_globals(_deepspeed_safe_globals()):
                return torch.load(path, map_location=map_location, weights_only=True)

    if type(engine.checkpoint_engine) is not TorchCheckpointEngine:
        raise RuntimeError(
            f"DeepSpeed chose {type(engine.checkpoint_engine).__name__}; peagle only knows how to load "
            "TorchCheckpointEngine files safely (remove any 'checkpoint' writer section from the DeepSpeed config)"
        )
    engine.checkpoint_engine = WeightsOnlyCheckpointEngine(engine._config)


# ----------------------------------------------------------------------------- RNG states


def capture_rng() -> dict:
    """Python, numpy and torch RNG states as JSON-able lists (no pickle)."""
    version, py_state, gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python": [version, list(py_state), gauss],
        "numpy": [np_kind, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict) -> None:
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


# ----------------------------------------------------------------------------- distributed


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# ----------------------------------------------------------------------------- weights


def gathered_state_dict(engine) -> dict[str, torch.Tensor] | None:
    """The drafter's full state dict on CPU on rank 0 (None elsewhere); collective.

    ZeRO-3 keeps each parameter partitioned across ranks, so it is gathered first; the
    other stages hold full parameters on every rank.
    """
    module = engine.module
    if engine.zero_optimization_partition_weights():
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            state = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()} if _rank() == 0 else None
        return state
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()} if _rank() == 0 else None


def replica_checksum(engine) -> float:
    """A float64 fingerprint of this rank's full parameters (ranks must agree exactly)."""
    module = engine.module
    params = list(module.parameters())

    def fingerprint() -> float:
        total = 0.0
        for i, p in enumerate(params):
            data = p.detach()
            total += (i + 1) * float(data.sum(dtype=torch.float64)) + float(data.float().square().sum(dtype=torch.float64))
        return total

    if engine.zero_optimization_partition_weights():
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return fingerprint()
    return fingerprint()


# ----------------------------------------------------------------------------- save / load


def save_checkpoint(
    engine,
    spec: HeadSpec,
    state: TrainerState,
    root: Path,
    keep_last: int,
    drafter_state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``step-NNNNNN`` atomically on every rank's behalf; collective (call on all ranks).

    ``drafter_state`` (rank 0) reuses a state dict already gathered for evaluation.
    Returns the checkpoint directory. Afterwards ``latest`` points at it, ``best`` at the
    checkpoint with the highest ``state.acceptance``, and older ones beyond ``keep_last``
    (other than the best) are removed.
    """
    root = Path(root)
    rank = _rank()
    name = checkpoint_name(state.step)
    tmp = root / f"{TMP_PREFIX}{name}"
    final = root / name
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()
    if drafter_state is None:
        drafter_state = gathered_state_dict(engine)
    engine.save_checkpoint(str(tmp / DEEPSPEED_DIR), tag=DEEPSPEED_TAG, save_latest=False)
    optimizer_tensors = consolidated_optimizer_state(engine)
    if rank == 0:
        save_file({k: v.contiguous() for k, v in drafter_state.items()}, str(tmp / DRAFTER_FILE))
        save_file(optimizer_tensors, str(tmp / OPTIMIZER_FILE), metadata=engine_counters(engine))
        (tmp / HEAD_SPEC_FILE).write_text(spec.to_json())
        (tmp / TRAINER_STATE_FILE).write_text(replace(state, rng=capture_rng()).to_json())
    else:
        (tmp / f"rng-rank-{rank}.json").write_text(json.dumps(capture_rng()))
    _barrier()
    if rank == 0:
        publish_dir(tmp, final)  # fsyncs the tree; a stale step of the same number is replaced whole
        write_pointer(root, LATEST, name, step=state.step)
        _update_best(root, name, state.acceptance)
        prune_checkpoints(root, keep_last)
    _barrier()
    return final


def _update_best(root: Path, name: str, acceptance: float | None) -> None:
    if acceptance is None:
        return
    current = best_acceptance(root)
    if current is None or acceptance > current:
        write_pointer(root, BEST, name, acceptance=acceptance)


def prune_checkpoints(root: Path, keep_last: int) -> list[Path]:
    """Remove checkpoints older than the last ``keep_last``, never the best; also stale temp dirs."""
    root = Path(root)
    keep = set(list_checkpoints(root)[-keep_last:])
    best = best_checkpoint(root)
    if best is not None:
        keep.add(best)
    removed = []
    for path in list_checkpoints(root):
        if path not in keep:
            shutil.rmtree(path)
            removed.append(path)
    for path in root.iterdir():
        if path.is_dir() and is_temp_name(path.name):  # an interrupted save or publish
            shutil.rmtree(path)
    return removed


def load_checkpoint(engine, checkpoint: Path) -> TrainerState:
    """Restore the engine (module, optimizer, scheduler, counters) and this rank's RNG; collective.

    At the checkpoint's own world size and ZeRO stage from DeepSpeed's engine checkpoint; at
    another one from the consolidated ``optimizer.safetensors`` (see the module docstring).
    """
    checkpoint = Path(checkpoint)
    state = read_trainer_state(checkpoint)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    same_stage = state.zero_stage is None or state.zero_stage == engine.zero_optimization_stage()
    if state.world_size == world_size and same_stage:
        load_path, _ = engine.load_checkpoint(
            str(checkpoint / DEEPSPEED_DIR),
            tag=DEEPSPEED_TAG,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
        )
        if load_path is None:
            raise FileNotFoundError(f"{checkpoint / DEEPSPEED_DIR} holds no DeepSpeed engine checkpoint")
    else:
        load_consolidated(engine, checkpoint, state.world_size)
    rank = _rank()
    own_rng = checkpoint / f"rng-rank-{rank}.json"
    # A rank the writing world did not have starts from rank 0's RNG (the data order never
    # depends on it: peagle.train.data seeds each example by its index).
    rng = json.loads(own_rng.read_text()) if rank != 0 and own_rng.is_file() else state.rng
    restore_rng(rng)
    return state


# ----------------------------------------------------------------------------- world-size-free optimizer state


def base_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer under DeepSpeed's wrappers (ZeRO / bf16 optimizers hold it as
    ``.optimizer``): torch's AdamW, or DeepSpeed's Muon (itself a ``torch.optim.Optimizer``)."""
    optimizer = engine.optimizer
    while not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def state_keys(muon: bool) -> tuple[str, ...]:
    """The per-parameter state of the half of the optimizer that trains it."""
    return MUON_STATE if muon else ADAMW_STATE


def _trained_by_muon(param: torch.nn.Parameter) -> bool:
    """DeepSpeed tags every model parameter ``use_muon`` when the optimizer is Muon."""
    return bool(getattr(param, "use_muon", False))


def _full_tensors(engine, param: torch.nn.Parameter, stepped: bool) -> dict[str, torch.Tensor]:
    """fp32 weights and optimizer state of one parameter, whole; collective under ZeRO.

    A parameter DeepSpeed does not shard (ZeRO-0 in fp32) is its own fp32 master, with
    its state in the optimizer's state under itself. Before the first step (``stepped``
    false) there is no state yet: zeros, what the first step starts from.
    """
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    keys = state_keys(_trained_by_muon(param))
    full = {"fp32": safe_get_full_fp32_param(param)}
    for key in keys:
        full[key] = safe_get_full_optimizer_state(param, key) if stepped and full["fp32"] is not None else None
        if full[key] is None and full["fp32"] is not None:
            full[key] = torch.zeros_like(full["fp32"])
    if full["fp32"] is None:
        own = base_optimizer(engine).state.get(param, {})
        full = {"fp32": param.detach(), **{key: own.get(key, torch.zeros_like(param)) for key in keys}}
    return {key: value.detach().float().cpu() for key, value in full.items()}


def consolidated_optimizer_state(engine) -> dict[str, torch.Tensor]:
    """``{"fp32/NAME", "exp_avg/NAME", "exp_avg_sq/NAME"}`` for every trained parameter
    (``"momentum_buffer/NAME"`` instead of the moments where Muon trains it); every rank
    computes them: DeepSpeed's accessors are collectives."""
    stepped = any(base_optimizer(engine).state.values())
    _link_optimizer_state(engine)
    tensors = {}
    for name, param in engine.module.named_parameters():
        if param.requires_grad:
            for key, value in _full_tensors(engine, param, stepped).items():
                tensors[f"{key}/{name}"] = value
    return tensors


def engine_counters(engine) -> dict[str, str]:
    """What DeepSpeed and the schedule count, as safetensors metadata (strings)."""
    steps = {float(s["step"]) for s in base_optimizer(engine).state.values() if "step" in s}
    if len(steps) > 1:
        raise RuntimeError(f"AdamW's parameter groups are at different steps {sorted(steps)}")
    return {
        "adam_step": str(steps.pop() if steps else 0.0),
        "lr_scheduler": json.dumps(engine.lr_scheduler.state_dict()),
        "global_steps": str(engine.global_steps),
        "global_samples": str(engine.global_samples),
        "skipped_steps": str(engine.skipped_steps),
    }


def _materialize_optimizer_state(engine) -> None:
    """Give every parameter the (zero) state its optimizer creates at its first step (AdamW:
    step and moments; Muon: its momentum), and let DeepSpeed map its fragments onto it, so
    the full-state setters have somewhere to write."""
    optimizer = base_optimizer(engine)
    for group in optimizer.param_groups:
        muon = bool(group.get("use_muon", False))
        for param in group["params"]:
            if not optimizer.state.get(param):
                zeros = {key: torch.zeros_like(param, memory_format=torch.preserve_format) for key in state_keys(muon)}
                optimizer.state[param] = zeros if muon else {"step": torch.tensor(0.0), **zeros}
    _link_optimizer_state(engine)


def _link_optimizer_state(engine) -> None:
    """Let every parameter's DeepSpeed fragment view AdamW's current state.

    ZeRO 1-2 / bf16 link those views once, after their first step, and ZeRO 1-2 do it after
    stepping only the first parameter group (DeepSpeed 0.19, measured: the no-decay group's
    norms and ``mask_hidden`` had no ``exp_avg``), so peagle links again before reading or
    writing the state. A private DeepSpeed method: checked, and a no-op where absent (ZeRO-0).
    """
    zero = engine.optimizer
    if hasattr(zero, "_lazy_init_hp_params_optimizer_state") and hasattr(zero, "_hp_optimizer_states_linked"):
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()


def load_consolidated(engine, checkpoint: Path, written_by: int) -> None:
    """Rebuild the engine's weights, optimizer state, schedule and counters at this world size
    from ``optimizer.safetensors``; collective. Refuses ZeRO-3 (see the module docstring)."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    path = checkpoint / OPTIMIZER_FILE
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if engine.zero_optimization_partition_weights():
        raise ValueError(
            f"{checkpoint} was written by {written_by} ranks at another world size or ZeRO stage than this run's "
            f"({world_size} ranks, ZeRO-3): ZeRO-3 resumes only as it wrote; resume with the train.launch that "
            "wrote it, or train with train.launch.zero_stage <= 2"
        )
    if not path.is_file():
        raise FileNotFoundError(
            f"{checkpoint} was written by {written_by} ranks at another world size or ZeRO stage, but it has no "
            f"{OPTIMIZER_FILE} (a checkpoint cut short while it was written): resume with the train.launch that wrote it"
        )
    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as fh:
        counters = fh.metadata()
    _materialize_optimizer_state(engine)
    optimizer = base_optimizer(engine)
    with torch.no_grad():
        for name, param in engine.module.named_parameters():
            if not param.requires_grad:
                continue
            fp32 = tensors[f"fp32/{name}"].to(param.device)
            param.data.copy_(fp32.to(param.dtype))  # the weights the next forward uses
            safe_set_full_fp32_param(param, fp32)  # ZeRO's master fragment (a no-op without ZeRO)
            for key in state_keys(_trained_by_muon(param)):
                value = tensors[f"{key}/{name}"].to(param.device)
                if hasattr(param, "_hp_mapping"):
                    safe_set_full_optimizer_state(param, value, key)
                else:
                    optimizer.state[param][key].copy_(value)
        for param_state in optimizer.state.values():
            if "step" in param_state:  # AdamW's; Muon keeps none
                param_state["step"] = torch.full_like(torch.as_tensor(param_state["step"]),
                                                      float(counters["adam_step"]))
    engine.lr_scheduler.load_state_dict(json.loads(counters["lr_scheduler"]))
    for group, lr in zip(engine.lr_scheduler.optimizer.param_groups, engine.lr_scheduler.get_last_lr()):
        group["lr"] = lr
    engine.global_steps = int(counters["global_steps"])
    engine.global_samples = int(counters["global_samples"])
    engine.skipped_steps = int(counters["skipped_steps"])
