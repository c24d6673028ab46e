"""Data parallelism for the data stage: N engine replicas, each call's prompts split over them.

vLLM 0.32's offline ``LLM`` runs one replica per process (data parallelism for dense
models is not supported inside it), so ``EnginePool`` starts each replica in a process
of its own, on its own devices (``replica_environments``), and splits every call's
prompts over the replicas in contiguous chunks. Results come back in prompt order, so
regeneration, extraction and the served split run unchanged on one engine or on many:
``open_engines`` gives one or the other from ``vllm.data_parallel_size``. Functions that
take an engine opt in with ``spread_over_replicas``.

A replica that dies fails the call with ``ReplicaLostError`` and the pool stops the
others at once. Nothing it was computing reaches the caller, and the data stage has
already made durable what came back before (samples.jsonl, finished shard samples),
so a rerun redoes only the rest.
"""

from __future__ import annotations

import functools
import os
import pickle
import queue
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from peagle.config import VllmConfig
from peagle.serving.engine import EngineStartError, open_llm, replica_environments, with_data_parallel_replicas

POLL_S = 2.0  # how often a waiting parent checks that its replicas are alive


class ReplicaLostError(EngineStartError):
    """An engine replica's process died while it had work (killed, out of memory, a crash)."""


@dataclass(frozen=True)
class ReplicaInfo:
    """What a started replica reports about its engine (the same for every replica)."""

    max_model_len: int
    vocab_size: int
    is_extraction: bool
    startup_s: float


class EnginePool:
    """Engine replicas in their own processes; ``map`` spreads one call's prompts over them."""

    def __init__(self, procs, inboxes, outbox):
        self._procs, self._inboxes, self._outbox = procs, inboxes, outbox
        self._job = 0
        self.info: ReplicaInfo | None = None  # set once every replica has started
        self.peagle_startup_s = 0.0

    @property
    def size(self) -> int:
        return len(self._procs)

    @classmethod
    def start(cls, model: str, vllm_cfg: VllmConfig, options: list[dict]) -> EnginePool:
        """Start one replica per entry of ``options`` (``open_llm``'s keyword arguments) and
        wait until every engine is up; a replica that fails to start stops them all."""
        import multiprocessing as mp

        envs = replica_environments(vllm_cfg)
        one = vllm_cfg.model_copy(update={"data_parallel_size": 1})
        ctx = mp.get_context("spawn")  # vLLM and torch threads do not survive a fork
        outbox, inboxes = ctx.Queue(), [ctx.Queue() for _ in envs]
        procs = [
            ctx.Process(target=_replica_main, name=f"peagle-engine-replica-{rank}",
                        args=(rank, env, os.getpid(), model, one, opts, inboxes[rank], outbox))
            for rank, (env, opts) in enumerate(zip(envs, options, strict=True))
        ]
        pool = cls(procs, inboxes, outbox)
        try:
            for p in procs:
                p.start()
            infos = pool._gather({rank: None for rank in range(len(procs))}, "starting its engine")
        except BaseException:
            pool._kill_all()
            raise
        pool.info = infos[0]
        pool.peagle_startup_s = max(i.startup_s for i in infos.values())
        return pool

    def map(self, fn: Callable, prompts: list, per_prompt: dict[str, list | None], **shared) -> list:
        """``fn(engine, chunk, **kwargs)`` on each replica's chunk of ``prompts``, results in
        prompt order; ``per_prompt`` lists are cut like the prompts, ``shared`` go to all."""
        bounds = even_chunks(len(prompts), self.size)
        jobs = {}
        for rank, (a, b) in enumerate(bounds):
            if a == b:
                continue
            self._job += 1
            kwargs = {**shared, **{k: v[a:b] for k, v in per_prompt.items() if v is not None}}
            self._inboxes[rank].put((self._job, fn, prompts[a:b], kwargs))
            jobs[rank] = self._job
        try:
            parts = self._gather(jobs, f"running {fn.__name__}")
        except ReplicaLostError:
            self._kill_all()
            raise
        return [item for rank in sorted(parts) for item in parts[rank]]

    def close(self) -> None:
        """Ask every replica to shut its engine down; kill the ones that do not in time."""
        for inbox in self._inboxes:
            inbox.put(None)
        for p in self._procs:
            p.join(timeout=120)
        self._kill_all()

    def _gather(self, jobs: dict[int, int | None], doing: str) -> dict[int, object]:
        """Each listed replica's answer to its job; a dead replica raises ReplicaLostError."""
        out = {}
        while len(out) < len(jobs):
            try:
                kind, rank, job, payload = self._outbox.get(timeout=POLL_S)
            except queue.Empty:
                self._check_alive([r for r in jobs if r not in out], doing)
                continue
            if rank not in jobs or job != jobs[rank]:
                continue  # an answer to a job abandoned earlier
            if kind == "error":
                raise payload if isinstance(payload, BaseException) else RuntimeError(payload)
            out[rank] = payload
        return out

    def _check_alive(self, ranks: list[int], doing: str) -> None:
        for rank in ranks:
            p = self._procs[rank]
            if p.exitcode is not None:
                raise ReplicaLostError(
                    f"engine replica {rank} of {self.size} (pid {p.pid}) exited with code {p.exitcode} while "
                    f"{doing}; the other replicas were stopped. Work returned before it is kept: rerun to "
                    "resume (the data stage redoes only the samples it has not stored)"
                )

    def kill(self) -> None:
        """Stop every replica now, its engine's processes included (work in flight is lost)."""
        self._kill_all()

    def _kill_all(self) -> None:
        """Kill each replica's process group: the replica and its engine's own processes."""
        for p in self._procs:
            if p.pid is None:
                continue
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if p.is_alive():  # killed before it had a group of its own
                p.kill()
            p.join(timeout=30)


@contextmanager
def open_engines(model: str, vllm_cfg: VllmConfig, *, replica_options: Callable[[int], dict] | None = None,
                 **options) -> Iterator:
    """One engine (``open_llm``), or an ``EnginePool`` of ``vllm.data_parallel_size`` replicas.

    ``options`` are ``open_llm``'s keyword arguments; ``replica_options(rank)`` adds
    per-replica ones (a scratch directory of its own, say).
    """
    extra = replica_options or (lambda rank: {})
    vllm_cfg = with_data_parallel_replicas(vllm_cfg)
    if vllm_cfg.data_parallel_size == 1:
        with open_llm(model, vllm_cfg, **options, **extra(0)) as llm:
            yield llm
        return
    pool = EnginePool.start(model, vllm_cfg, [{**options, **extra(r)} for r in range(vllm_cfg.data_parallel_size)])
    try:
        yield pool
    except KeyboardInterrupt:  # Ctrl-C stops the command at once (the replicas are process groups of their own)
        pool.kill()
        raise
    finally:
        pool.close()


def spread_over_replicas(*per_prompt: str):
    """Let ``fn(engine, prompts, **kwargs)`` take an ``EnginePool`` too: the prompts (and the
    per-prompt keyword lists named here) are split over the replicas, each running ``fn``
    on its own engine. ``fn`` must be a module-level function (it is sent by name)."""

    def wrap(fn):
        @functools.wraps(fn)
        def call(llm, prompts, **kwargs):
            if isinstance(llm, EnginePool):
                lists = {k: kwargs.pop(k, None) for k in per_prompt}
                return llm.map(call, prompts, lists, **kwargs)
            return fn(llm, prompts, **kwargs)

        return call

    return wrap


def even_chunks(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous [start, end) ranges covering range(n), sizes differing by one at most."""
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (i < extra)
        bounds.append((start, end))
        start = end
    return bounds


def _replica_main(rank, env, parent_pid, model, vllm_cfg, options, inbox, outbox) -> None:
    """One replica: its own process group and devices, one engine, jobs in, answers out."""
    os.setpgrp()  # so the pool can stop this replica together with its engine's processes
    os.environ.update(env)  # before vLLM touches any device
    try:
        with open_llm(model, vllm_cfg, **options) as llm:
            info = ReplicaInfo(engine_max_model_len(llm), engine_vocab_size(llm), is_extraction_engine(llm),
                               llm.peagle_startup_s)
            outbox.put(("ready", rank, None, info))
            while (job := _next_job(inbox, parent_pid)) is not None:
                job_id, fn, prompts, kwargs = job
                try:
                    outbox.put(("done", rank, job_id, fn(llm, prompts, **kwargs)))
                except Exception as err:
                    outbox.put(("error", rank, job_id, _sendable(err)))
    except BaseException as err:  # a failed start: the parent raises it
        outbox.put(("error", rank, None, EngineStartError(f"engine replica {rank}: {type(err).__name__}: {err}")))


def _next_job(inbox, parent_pid: int):
    """The next job, or None when told to stop or when the parent is gone (no orphans)."""
    while True:
        try:
            return inbox.get(timeout=POLL_S)
        except queue.Empty:
            if os.getppid() != parent_pid:
                return None


def _sendable(err: Exception) -> BaseException | str:
    try:
        pickle.dumps(err)
        return err
    except Exception:
        return f"{type(err).__name__}: {err}"


# What an engine was started with: asked of a vLLM engine or of a pool (its replicas' report).


def engine_max_model_len(llm) -> int:
    """The context length the engine was started with."""
    if isinstance(llm, EnginePool):
        return llm.info.max_model_len
    return int(llm.llm_engine.model_config.max_model_len)


def engine_vocab_size(llm) -> int:
    if isinstance(llm, EnginePool):
        return llm.info.vocab_size
    return int(llm.llm_engine.model_config.get_vocab_size())


def is_extraction_engine(llm) -> bool:
    """True for an engine started with vLLM's ``extract_hidden_states`` method."""
    if isinstance(llm, EnginePool):
        return llm.info.is_extraction
    spec = llm.llm_engine.vllm_config.speculative_config
    return spec is not None and spec.method == "extract_hidden_states"
