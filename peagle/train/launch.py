"""Start drafter training in its own process group: torchrun on one or several hosts, or DeepSpeed's launcher.

Entry point (what every rank runs)::

    python -m peagle.train.launch --config configs/demo.yaml [--set train.recipe.epochs=3] \\
        --data-dir RUN/data --target TARGET_DIR --out RUN/checkpoints/peagle/IDENTITY
    python -m peagle.train.launch --config-json '{"name": ..., ...}' ...   # or a .json path

That rank trains without evaluating. A program above training that hands the trainer more
(``peagle.rank``: the pipeline's rank, with offline evaluation) runs ``rank_main`` itself and is
launched in its place (``launch_training(..., rank_module=...)``).

``launch_training`` runs it as a subprocess and waits; ``cfg.train`` picks the launcher:

- one node (``train.launch.nodes == 1``): ``python -m torch.distributed.run --standalone
  --nproc_per_node=WORLD_SIZE -m peagle.train.launch ...`` (one process per GPU; on CPU,
  gloo processes).
- ``train.launch.nodes = N`` with ``train.launch.rdzv_endpoint = HOST:PORT``: every node runs the same
  peagle command (``peagle train``, ``peagle run`` or a Prefect deployment, same config),
  and each node's launcher runs ``torchrun --nnodes=N --nproc_per_node=WORLD_SIZE/N
  --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT --rdzv_id=ID``; the launchers meet there
  (waiting up to ``train.launch.rdzv_timeout_s``) and torch numbers the ranks. ``ID`` is
  ``train.launch.rdzv_id`` or derived from the checkpoint directory, which must be the same path
  on a filesystem every node shares (checkpoints, ``metrics.jsonl`` and
  ``train_result.json`` are written there by global rank 0, wherever it runs, and every
  node's launcher reads them from there).
- ``train.launch.hostfile`` (DeepSpeed format, one ``HOST slots=GPUS`` line per host, slots summing
  to ``train.launch.world_size``, every host reachable by passwordless ssh/pdsh, same paths and
  Python env, a shared ``out_dir``): this host alone runs::

      deepspeed --hostfile HOSTFILE --master_addr FIRST_HOST --module peagle.train.launch \\
          --config-json OUT/launch_config.json --data-dir ... --target ... --out ...

Either launcher exports, per process, ``RANK`` (global: picks the data shard; rank 0 writes
checkpoints, metrics and the result), ``LOCAL_RANK`` (on its host: picks the GPU),
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; ``engine.init_process_group`` reads
exactly those.

Before any rank starts, the dataset is checked (``peagle.data.check.check_dataset``: complete,
every shard sound, each hashed once per file identity), unless the caller did, and the
checkpoint disk must hold the checkpoints the run keeps (``checkpoint_space_needed``).

Every rank's output (DeepSpeed, torch, tracebacks) goes to ``OUT/train.log`` as it comes
(and to the ``peagle.train.ranks`` logger at DEBUG); a non-zero exit raises
``TrainingFailed`` with its last lines. While the ranks run, rank 0's ``metrics.jsonl`` is
followed and each step's progress (step, loss, tokens/s, ETA) is logged at INFO on
``peagle.train.launch``, so whoever shows peagle's logs (the CLI, a Prefect run) shows
training live; the same records go to ``on_metrics`` (the pipeline's MLflow stage run) as
they come. Rank 0 writes ``train_result.json``, which becomes the returned ``TrainResult``
(on every node: they all read the shared checkpoint directory).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from peagle import identity as identities
from peagle.checkpoint_format import latest_checkpoint, list_checkpoints, read_trainer_state
from peagle.config import ConfigError, PipelineConfig, TrainConfig, load_config, parse_config, parse_overrides
from peagle.facts import head_spec_for, load_dataset_facts
from peagle.fileio import json_digest, write_text_atomic
from peagle.layout import LAUNCH_CONFIG_FILE, METRICS_FILE, DataLayout, spool_dir
from peagle.paths import configure_environment
from peagle.serving.engine import engine_gpus, is_cpu_platform, visible_gpus, with_data_parallel_replicas
from peagle.train.trainer import RESULT_FILE, TrainResult

LAUNCH_CONFIG = LAUNCH_CONFIG_FILE
RANK_MODULE = "peagle.train.launch"  # this module, by the name ranks start it under (-m runs it as __main__)
RANK_OUTPUT = "train.log"  # every rank's stdout/stderr, in the checkpoint directory
TAIL_LINES = 40
# What a training with a separate producer writes into its head directory when it fails or is
# stopped: that producer (`peagle produce`, started before it) stops too.
TRAINING_FAILED_FILE = "training_failed.txt"
POLL_S = 1.0  # how often the launcher looks: rank 0's metrics.jsonl while the ranks run, a separate producer's spool
PROGRESS_EVERY_S = 10.0  # at most one progress line per this many seconds (first and last step always)
log = logging.getLogger(__name__)
rank_log = logging.getLogger("peagle.train.ranks")
DIST_ENV = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT"}


class TrainingFailed(RuntimeError):
    """The training processes exited with an error; the message carries their last output."""


# ----------------------------------------------------------------------------- parent side


def training_command(
    cfg_json: Path, data_dir: Path, target_path: str, out_dir: Path, train: TrainConfig,
    rank_module: str = RANK_MODULE, progress: bool = True, head_identity: str | None = None,
) -> list[str]:
    """The launcher command line for ``train``'s launch settings (see the module docstring), every
    rank running ``python -m rank_module``, told the head's identity when given."""
    args = ["--config-json", str(cfg_json), "--data-dir", str(data_dir), "--target", str(target_path), "--out", str(out_dir)]
    if head_identity is not None:
        args += ["--head-identity", head_identity]
    if not progress:
        args.append("--no-progress")
    if train.launch.hostfile is not None:
        hosts = hostfile_slots(Path(train.launch.hostfile), train.launch.world_size)
        return ["deepspeed", "--hostfile", str(train.launch.hostfile), "--master_addr", next(iter(hosts)),
                "--module", rank_module, *args]
    if train.launch.nodes == 1:
        where = ["--standalone"]
    else:
        where = [
            f"--nnodes={train.launch.nodes}", "--rdzv_backend=c10d", f"--rdzv_endpoint={train.launch.rdzv_endpoint}",
            f"--rdzv_id={train.launch.rdzv_id or rendezvous_id(out_dir)}",
            f"--rdzv_conf=join_timeout={train.launch.rdzv_timeout_s}",
        ]
    return [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc_per_node={train.launch.ranks_per_node}",
            "-m", rank_module, *args]


def rendezvous_id(out_dir: Path) -> str:
    """The default rendezvous id: the checkpoint directory's path, which every node shares."""
    return "peagle-" + json_digest(str(Path(out_dir).absolute()))


def hostfile_slots(path: Path, world_size: int) -> dict[str, int]:
    """``HOST slots=N`` lines of a DeepSpeed hostfile, checked against ``train.launch.world_size``."""
    if not path.is_file():
        raise ConfigError(f"train.launch.hostfile {str(path)!r} does not exist; write one 'HOST slots=GPUS' line per host")
    hosts: dict[str, int] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        words = line.split("#")[0].split()
        if not words:
            continue
        slots = [w.split("=", 1)[1] for w in words[1:] if w.startswith("slots=")]
        if len(words) != 2 or len(slots) != 1 or not slots[0].isdigit() or int(slots[0]) < 1:
            raise ConfigError(f"{path}:{number}: {line.strip()!r} is not 'HOST slots=GPUS'")
        hosts[words[0]] = int(slots[0])
    if not hosts:
        raise ConfigError(f"train.launch.hostfile {str(path)!r} names no host; write one 'HOST slots=GPUS' line per host")
    if sum(hosts.values()) != world_size:
        raise ConfigError(
            f"train.launch.hostfile {str(path)!r} has {sum(hosts.values())} slots but train.launch.world_size is {world_size}; "
            "set train.launch.world_size to the slots' sum (a rank each) or edit the hostfile"
        )
    return hosts


def launch_training(
    cfg: PipelineConfig,
    data_dir: Path,
    target_path: str,
    out_dir: Path,
    *,
    rank_module: str = RANK_MODULE,
    dataset_checked: bool = False,
    progress: bool = True,
    env: dict[str, str] | None = None,
    on_metrics: Callable[[list[dict]], None] | None = None,
    head_identity: str | None = None,
) -> TrainResult:
    """Train in ``train.launch.world_size`` fresh processes (this node's share of them when
    ``train.launch.nodes`` > 1) and return rank 0's ``TrainResult``.

    ``rank_module`` is the program every rank runs (``rank_main`` with what it hands the
    trainer; this module's own trains without evaluating). The dataset is checked first unless
    ``dataset_checked`` (a ``HeadPlan``'s was, when it was planned). ``on_metrics(records)`` receives rank 0's new
    ``metrics.jsonl`` records (steps after the resume point) about once a second while the
    ranks run; it runs in this process, so the ranks never talk to a tracking server.
    ``head_identity`` (a ``HeadPlan``'s) is what every rank checks a resumed checkpoint against;
    worked out here from ``cfg`` and the dataset when not given, never by the ranks.
    """
    from peagle.data.check import check_dataset

    check_optimizer_runs_here(cfg.train)
    if not dataset_checked:
        check_dataset(data_dir)
    out_dir = Path(out_dir)
    check_checkpoint_space(cfg, Path(data_dir), out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg_json = out_dir / LAUNCH_CONFIG
    write_text_atomic(cfg_json, cfg.model_dump_json(by_alias=True, indent=1))
    (out_dir / RESULT_FILE).unlink(missing_ok=True)
    (out_dir / TRAINING_FAILED_FILE).unlink(missing_ok=True)  # an earlier attempt's
    identity = head_identity or identities.head_identity(cfg, identities.dataset_manifests(data_dir))
    cmd = training_command(cfg_json, Path(data_dir), target_path, out_dir, cfg.train, rank_module, progress, identity)
    # A caller that is itself a rank (tests, notebooks) must not leak its rendezvous to the children.
    child_env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    child_env.update({"PYTHONUNBUFFERED": "1", **(env or {})})
    if cfg.train.launch.devices:  # the ranks' GPUs; LOCAL_RANK picks one of them
        child_env["CUDA_VISIBLE_DEVICES"] = ",".join(cfg.train.launch.devices)
    total = planned_steps(cfg, Path(data_dir))
    progress_log = TrainingProgress(out_dir / METRICS_FILE, total, f"train {cfg.train.method}",
                                    resumed_at=resume_step(out_dir), on_records=on_metrics,
                                    budget_s=cfg.train.recipe.max_train_seconds)
    budget = f"{cfg.train.recipe.max_train_seconds:.0f} s of" if cfg.train.recipe.max_train_seconds else None
    log.info("training %s: %d rank(s) on %d node(s), %s optimizer steps; rank output in %s", cfg.train.method,
             cfg.train.launch.world_size, cfg.train.launch.nodes, budget or (total if total is not None else "?"),
             out_dir / RANK_OUTPUT)
    with hidden_states_beside_ranks(cfg, Path(data_dir), target_path, out_dir, total):
        run_streaming(cmd, child_env, output=out_dir / RANK_OUTPUT, on_poll=progress_log.poll)
    progress_log.poll(final=True)
    result_path = out_dir / RESULT_FILE
    if not result_path.exists():
        raise TrainingFailed(f"training exited cleanly but wrote no {result_path}")
    return TrainResult.from_json(result_path.read_text())


@contextmanager
def hidden_states_beside_ranks(cfg: PipelineConfig, data_dir: Path, target_path: str, out_dir: Path,
                               total_steps: int | None):
    """Nothing for a stored dataset. For a streamed one (``data.hidden_states: streamed``), one
    vLLM extraction engine in this process writes the hidden states the ranks read next into
    the head's spool (``peagle.data.spool``), from the ranks' resume point on, while the block
    runs them; the spool is removed after. With ``train.launch.nodes`` > 1 one node's launcher does
    (``producer_lock``); the others' ranks read what it writes."""
    from peagle.data.spool import LOCK_FILE, is_streamed, producer_lock

    if not is_streamed(DataLayout(data_dir).train):
        yield
        return
    if cfg.data.producer == "separate":
        wait_for_separate_producer(cfg, out_dir)
        try:
            yield
        except BaseException as err:  # a failure or Ctrl-C: the producer stops when it reads this
            write_text_atomic(out_dir / TRAINING_FAILED_FILE, f"{type(err).__name__}: {err}\n")
            raise
        return
    check_engines_apart_from_ranks(cfg)
    with producer_lock(out_dir) as producer:
        if producer:
            with spool_produced_here(cfg, data_dir, target_path, out_dir, total_steps):
                yield
        elif cfg.train.launch.nodes > 1:
            log.info("training on a streamed dataset: another node's launcher extracts the hidden states (it holds "
                     "%s); this node's ranks read them from the shared spool", out_dir / LOCK_FILE)
            yield
        else:
            raise ConfigError(
                f"another process is already training this head ({out_dir}; it holds {out_dir / LOCK_FILE}): "
                "let it finish or stop it, then rerun (training resumes from the last checkpoint)")


def wait_for_separate_producer(cfg: PipelineConfig, out_dir: Path) -> None:
    """``data.producer: separate``: wait (up to ``data.producer_wait_s``) until ``peagle produce``
    runs for this head (its spool's heartbeat is fresh) with a spool planned from this run's
    resume point, so the ranks start reading what it writes."""
    from peagle.data.spool import HEARTBEAT_EVERY_S, LOCK_FILE, Spool

    start_step, spool = resume_step(out_dir), Spool(spool_dir(out_dir))
    log.info("training on a streamed dataset: waiting up to %s for `peagle produce` (data.producer: separate) to "
             "extract the hidden states into %s", format_duration(cfg.data.producer_wait_s), spool.root)
    deadline = time.monotonic() + cfg.data.producer_wait_s
    while True:
        try:
            planned = spool.plan().start_step == start_step
        except (FileNotFoundError, ValueError):  # not started yet, or clearing an old spool to start afresh
            planned = False
        beat = spool.heartbeat_age()
        if planned and beat is not None and beat < 5 * HEARTBEAT_EVERY_S:  # a live producer, not a killed one's
            log.info("training on a streamed dataset: the separate producer extracts from step %d on", start_step)
            return
        if time.monotonic() > deadline:
            raise ConfigError(
                f"data.producer: separate, but no `peagle produce` extracted for this head within "
                f"data.producer_wait_s ({cfg.data.producer_wait_s:g} s): no producer holds {out_dir / LOCK_FILE} "
                f"with a spool planned from step {start_step}. Run `peagle produce CONFIG` (the same config and "
                "--set) on a host that sees this run directory, or set data.producer: launcher to extract beside "
                "the ranks")
        time.sleep(POLL_S)


def produce_separately(cfg: PipelineConfig, data_dir: Path, target_path: str, out_dir: Path,
                       training_ended: Callable[[], bool] | None = None) -> bool:
    """``peagle produce``: extract the head's streamed train split into its spool for ``peagle
    train`` running elsewhere (``data.producer: separate``), and keep the spool until that
    training writes its result; True once it has. A training that fails or is stopped stops it
    too (its launcher writes ``TRAINING_FAILED_FILE``), as does ``training_ended()`` (the train
    flow's producer asks Prefect about its training's task run): False. Refused when another
    process already extracts for the head; a producer error ends it (the ranks waiting on it
    stop with the same error)."""
    from peagle.data.spool import LOCK_FILE, Spool, is_streamed, producer_lock

    if not is_streamed(DataLayout(data_dir).train):
        raise ConfigError(f"{data_dir}: its train split is stored with its hidden states; `peagle produce` extracts "
                          "only for a streamed one (data.hidden_states: streamed)")
    out_dir.mkdir(parents=True, exist_ok=True)
    with producer_lock(out_dir) as held:
        if not held:
            raise ConfigError(f"another process already extracts for this head (it holds {out_dir / LOCK_FILE}): "
                              "one producer serves every rank")
        started, result, spool = time.time(), out_dir / RESULT_FILE, Spool(spool_dir(out_dir))

        def written_since_start(path: Path) -> bool:
            return path.exists() and path.stat().st_mtime >= started

        def failed() -> bool:
            return written_since_start(out_dir / TRAINING_FAILED_FILE) or bool(training_ended and training_ended())

        with spool_produced_here(cfg, data_dir, target_path, out_dir, planned_steps(cfg, data_dir)):
            log.info("separate producer: extracting for the ranks of `peagle train` until it writes %s", result)
            while not written_since_start(result) and spool.producer_problem() is None and not failed():
                time.sleep(POLL_S)
    if not written_since_start(result):
        log.warning("separate producer: the training ended without a result; its spool is removed")
        return False
    log.info("separate producer: the training finished; its spool is removed")
    return True


@contextmanager
def spool_produced_here(cfg: PipelineConfig, data_dir: Path, target_path: str, out_dir: Path,
                        total_steps: int | None):
    """This launcher's producer: the spool's plan (kept whole when the split fits under the cap),
    one extraction engine, and ``producing`` while the block trains."""
    from peagle.data.extract import extract_with_engine, open_data_engine
    from peagle.data.spool import SpoolPlan, chunk_samples_for, keeps_whole_split, producing, start_spool
    from peagle.data.store import ShardReader, bytes_per_token
    from peagle.train.data import training_samples

    data = DataLayout(data_dir)
    facts = load_dataset_facts(data)
    reader = ShardReader(data.train)
    tokens = training_samples(reader, cfg.train.recipe.max_samples)
    layers, ht, dtype = facts.stored_layer_ids, facts.target_hidden_size, cfg.data.storage_dtype
    cap = int(cfg.data.spool_gib * 2**30)
    t = cfg.train
    per_token, lengths = bytes_per_token(len(layers), ht, dtype), reader.lengths()
    plan = SpoolPlan(num_samples=len(tokens), seed=t.recipe.seed, world_size=t.launch.world_size,
                     micro_batch_size=t.recipe.micro_batch_size, grad_accum=t.grad_accum,
                     chunk_samples=chunk_samples_for(cap, max(lengths), per_token, len(tokens)),
                     start_step=resume_step(out_dir), total_steps=total_steps)
    plan = replace(plan, kept=keeps_whole_split(plan, lengths, per_token, cap))
    spool = start_spool(spool_dir(out_dir), plan)
    log.info("training on a streamed dataset: hidden states extracted beside the ranks into %s (at most %s GiB, "
             "%d samples a chunk); %s", spool.root, f"{cfg.data.spool_gib:g}", plan.chunk_samples,
             "the whole split fits: extracted once and kept for every epoch" if plan.kept
             else "each chunk deleted once read, every epoch extracted again" if plan.reads_again
             else "each chunk deleted once read")
    tc = cfg.target
    scratch = out_dir / ".extraction"  # vLLM's per-request files, beside the spool: the cap is the spool's
    try:
        with open_data_engine(target_path, with_data_parallel_replicas(cfg.vllm), layers, scratch,
                              revision=tc.revision, trust_remote_code=tc.trust_remote_code, dtype=tc.dtype) as llm:
            def extract(sequences):
                return extract_with_engine(llm, sequences, batch_size=cfg.data.extract_batch_size, progress=False)

            with producing(spool, tokens, extract, layers, ht, dtype, cap):
                yield
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def check_engines_apart_from_ranks(cfg: PipelineConfig) -> None:
    """On GPUs, a streamed dataset's engines and the ranks beside them each need their own
    (``vllm.devices``, ``train.launch.devices``); on CPU they share the cores."""
    if is_cpu_platform():
        return
    vllm = with_data_parallel_replicas(cfg.vllm)
    engines = engine_gpus(cfg.vllm)[: vllm.data_parallel_size * vllm.tensor_parallel_size]
    ranks = list(cfg.train.launch.devices) if cfg.train.launch.devices else visible_gpus()[: cfg.train.launch.ranks_per_node]
    problem = devices_shared(engines, ranks)
    if problem:
        raise ConfigError(problem)


def devices_shared(engines: list[str], ranks: list[str]) -> str | None:
    """What is wrong when the engines' GPUs and the ranks' overlap, with the fix; else None."""
    shared = [d for d in engines if d in ranks]
    if not shared:
        return None
    return (f"data.hidden_states: streamed extracts beside training, but GPU(s) {', '.join(shared)} would serve both "
            f"vLLM (engines on {', '.join(engines)}) and the ranks (on {', '.join(ranks)}): set vllm.devices and "
            "train.launch.devices to GPUs of their own (e.g. vllm.devices: ['6', '7'] and train.launch.devices: "
            "['0', '1', '2', '3', '4', '5'] with train.launch.world_size: 6 on 8 GPUs)")


def check_optimizer_runs_here(train: TrainConfig) -> None:
    """Muon's update is compiled (DeepSpeed decorates it with torch.compile); on a CPU,
    torch's inductor builds it with a C++ compiler, so without one every rank would fail at
    its first step. Raised before any rank starts."""
    import shutil

    from peagle.train.engine import use_gpu

    if train.recipe.optimizer != "muon" or use_gpu():
        return
    if not (shutil.which(os.environ.get("CXX") or "g++") or shutil.which("clang++")):
        raise ConfigError(
            "train.recipe.optimizer: muon compiles its update with torch.compile, which on a CPU needs a C++ compiler, "
            "and this machine has none (no g++ or clang++ on PATH, CXX unset): install one (Debian: apt-get install "
            "g++) or set train.recipe.optimizer: adamw"
        )


# What one checkpoint holds per drafter value, at most (fp32): drafter.safetensors and DeepSpeed's
# module states hold every value, DeepSpeed keeps frozen ones once more ("frozen fragments"),
# and DeepSpeed's optimizer states and optimizer.safetensors each hold a trained value's fp32
# weight and AdamW's two moments (Muon keeps less). Measured on the tiny test drafter (82K
# values, 58K trained): 2.23 MB on disk against 2.15 MB by these counts, the rest being
# fixed-size files (DeepSpeed's scripts, trainer_state.json): CHECKPOINT_FIXED_BYTES.
BYTES_PER_VALUE = 4 + 4
BYTES_PER_FROZEN_VALUE = 4
BYTES_PER_TRAINED_VALUE = 12 + 12
CHECKPOINT_FIXED_BYTES = 1 << 20


def checkpoint_bytes(cfg: PipelineConfig, data_dir: Path) -> int:
    """What one checkpoint of ``cfg``'s head on this dataset takes on disk, at most: from the
    drafter's parameter count (built on the meta device: no memory, no weights read)."""
    import torch

    from peagle.methods import get_method
    from peagle.model import PEagleDrafter

    spec = head_spec_for(cfg, load_dataset_facts(DataLayout(data_dir)))
    with torch.device("meta"):
        drafter = PEagleDrafter(spec)
        get_method(cfg.train.method).prepare_drafter(drafter, cfg.train)
    values = sum(t.numel() for t in drafter.state_dict().values())
    trained = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in drafter.parameters() if not p.requires_grad)
    return (values * BYTES_PER_VALUE + frozen * BYTES_PER_FROZEN_VALUE + trained * BYTES_PER_TRAINED_VALUE
            + CHECKPOINT_FIXED_BYTES)


def checkpoint_space_needed(cfg: PipelineConfig, data_dir: Path, out_dir: Path) -> tuple[int, int, int]:
    """(bytes still needed, checkpoints on disk at once, bytes each): ``train.checkpoints.keep_last`` + the best
    + the one being written before the oldest is pruned, less what the checkpoints already in
    ``out_dir`` (a resumed run's) take."""
    each = checkpoint_bytes(cfg, data_dir)
    at_once = cfg.train.checkpoints.keep_last + 2
    existing = sum(f.stat().st_size for step in list_checkpoints(out_dir) for f in step.rglob("*") if f.is_file()) \
        if out_dir.is_dir() else 0
    return max(0, at_once * each - existing), at_once, each


def check_checkpoint_space(cfg: PipelineConfig, data_dir: Path, out_dir: Path) -> None:
    """Refuse (``DiskSpaceError``) before any rank starts when the checkpoints cannot fit."""
    from peagle.data.spool import is_streamed
    from peagle.data.store import check_free_space, format_bytes

    needed, at_once, each = checkpoint_space_needed(cfg, data_dir, out_dir)
    spool = int(cfg.data.spool_gib * 2**30) if is_streamed(DataLayout(data_dir).train) else 0
    check_free_space(
        out_dir, needed + spool,
        what=f"training ({at_once} checkpoints of up to {format_bytes(each)} on disk at once: train.checkpoints.keep_last="
             f"{cfg.train.checkpoints.keep_last}, the best and the one being written"
             + (f"; the streamed dataset's spool, data.spool_gib {format_bytes(spool)}" if spool else "") + ")",
        fixes="Free some space, point `workdir` or PEAGLE_HOME at a larger disk, or lower train.checkpoints.keep_last"
              + (" or data.spool_gib." if spool else "."),
    )


def planned_steps(cfg: PipelineConfig, data_dir: Path) -> int | None:
    """The optimizer steps the ranks will run (for the ETA); None when the dataset is unreadable
    (the ranks then fail with the reason)."""
    if cfg.train.recipe.max_steps:
        return cfg.train.recipe.max_steps
    if cfg.train.recipe.max_train_seconds:
        return None  # as many as the time budget allows
    from peagle.data.store import ShardReader
    from peagle.train.data import BatchPlan, training_samples

    try:
        samples = len(training_samples(ShardReader(DataLayout(data_dir).train, verify=False), cfg.train.recipe.max_samples))
    except (OSError, ValueError, KeyError):
        return None
    plan = BatchPlan(samples, cfg.train.launch.world_size, cfg.train.recipe.micro_batch_size, cfg.train.grad_accum)
    return plan.steps_per_epoch * cfg.train.recipe.epochs or None


def resume_step(out_dir: Path) -> int:
    """The step the ranks resume from (their latest checkpoint's), 0 for a fresh start."""
    latest = latest_checkpoint(out_dir)
    return read_trainer_state(latest).step if latest is not None else 0


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


@dataclass
class TrainingProgress:
    """Follows rank 0's ``metrics.jsonl`` while the ranks run and logs progress lines.

    Reads only whole lines past its offset; a file replaced or truncated (a fresh start, or a
    resume dropping steps its checkpoint lacks) is read again from the top. Steps up to
    ``resumed_at`` (the checkpoint the ranks resume from) and steps already reported are skipped.
    Each poll's new records also go to ``on_records``; its failure (a tracking server
    down) is logged and never stops the ranks.
    """

    path: Path
    total_steps: int | None
    label: str
    resumed_at: int = 0
    every_s: float = PROGRESS_EVERY_S
    budget_s: float | None = None  # train.recipe.max_train_seconds: reported against the records' train_seconds
    on_records: Callable[[list[dict]], None] | None = None
    _offset: int = 0
    _inode: int | None = None
    _reported_step: int = -1
    _last_line_at: float = float("-inf")
    _first: tuple[int, float] | None = None  # (step, time) of the first step seen by this launch
    _pending: dict | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._reported_step = max(self._reported_step, self.resumed_at)

    def poll(self, final: bool = False) -> None:
        now = time.monotonic()
        fresh = [r for r in self._new_records() if r.get("step", 0) > self.resumed_at]
        for record in fresh:
            if "eval/acceptance" in record:
                log.info("%s: step %d offline acceptance %.3f (held-out)", self.label, record["step"],
                         record["eval/acceptance"])
            elif "loss" in record and record["step"] > self._reported_step:
                self._pending = record
                if self._first is None:
                    self._first = (record["step"] - 1, now - float(record.get("step_time_s", 0.0)))
                first_or_last = record["step"] == self.resumed_at + 1 or record["step"] == self.total_steps
                if first_or_last or now - self._last_line_at >= self.every_s:
                    self._report(record, now)
        if final and self._pending is not None and self._pending["step"] > self._reported_step:
            self._report(self._pending, now)
        if fresh and self.on_records is not None:
            self._hand_on(fresh)

    def _hand_on(self, records: list[dict]) -> None:
        try:
            self.on_records(records)
        except Exception as err:  # noqa: BLE001 - metrics are never worth a training run
            log.warning("%s: could not record steps %d-%d (%s: %s); training goes on", self.label,
                        records[0].get("step", 0), records[-1].get("step", 0), type(err).__name__, err)

    def _report(self, record: dict, now: float) -> None:
        step = record["step"]
        parts = [f"{self.label}: step {step}" + (f"/{self.total_steps}" if self.total_steps else ""),
                 f"loss {record['loss']:.4f}"]
        if "acc" in record:
            parts.append(f"acc {record['acc']:.3f}")
        parts.append(f"{record.get('tokens_per_s', 0.0):,.0f} tokens/s")
        if self.budget_s and "train_seconds" in record:
            parts.append(f"{record['train_seconds']:.0f}/{self.budget_s:.0f} s of training")
        if self.total_steps and self._first is not None and step < self.total_steps:
            done = step - self._first[0]
            per_step = (now - self._first[1]) / done if done > 0 else float(record.get("step_time_s", 0.0))
            parts.append(f"ETA {format_duration(per_step * (self.total_steps - step))}")
        log.info(", ".join(parts))
        self._reported_step, self._last_line_at = step, now

    def _new_records(self) -> list[dict]:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return []
        if stat.st_ino != self._inode or stat.st_size < self._offset:
            self._inode, self._offset = stat.st_ino, 0
        if stat.st_size == self._offset:
            return []
        with self.path.open("rb") as fh:
            fh.seek(self._offset)
            chunk = fh.read(stat.st_size - self._offset)
        whole = chunk[: chunk.rfind(b"\n") + 1]  # a line being written is read next time
        self._offset += len(whole)
        records = []
        for line in whole.decode("utf-8", errors="replace").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return records


def run_streaming(cmd: list[str], env: dict[str, str] | None = None, *, output: Path | None = None,
                  on_poll: Callable[[], None] | None = None, poll_s: float = POLL_S) -> None:
    """Run ``cmd``; its output lines go to ``output`` (appended) and the ``peagle.train.ranks``
    logger (DEBUG) as they come, and ``on_poll()`` runs every ``poll_s`` seconds in the calling
    thread (which keeps the caller's logging context, e.g. a Prefect task run). A non-zero
    exit raises ``TrainingFailed`` with the last lines."""
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, bufsize=1)
    except FileNotFoundError as err:
        raise TrainingFailed(f"cannot start the launcher ({err}); is DeepSpeed installed in this environment?") from None
    assert proc.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=read, name="rank-output", daemon=True)
    sink = open(output, "a", encoding="utf-8") if output is not None else None  # noqa: SIM115
    try:
        reader.start()
        next_poll = time.monotonic() + poll_s
        while True:
            try:
                line = lines.get(timeout=max(0.0, next_poll - time.monotonic()))
            except queue.Empty:
                line = ""
            if line is None:
                break
            if line:
                text = line.rstrip("\n")
                tail.append(text)
                rank_log.debug(text)
                if sink is not None:
                    sink.write(line)
                    sink.flush()
            if on_poll is not None and time.monotonic() >= next_poll:
                on_poll()
                next_poll = time.monotonic() + poll_s
        code = proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        if sink is not None:
            sink.close()
    if code != 0:
        raise TrainingFailed(
            f"training exited with code {code}\ncommand: {' '.join(cmd)}\nlast output:\n" + "\n".join(tail)
        )


# ----------------------------------------------------------------------------- child side


def _load_cfg(args) -> PipelineConfig:
    if args.config:
        return load_config(args.config, parse_overrides(args.set))
    text = args.config_json
    if not text.lstrip().startswith("{"):
        path = Path(text)
        if not path.is_file():
            raise ConfigError(f"--config-json {text!r}: neither inline JSON nor an existing file")
        text = path.read_text()
    return parse_config(json.loads(text), "--config-json")


# ``make_eval_fn(cfg, data_dir, target_path) -> eval_fn(drafter) -> acceptance``: what a rank
# program hands the trainer to choose checkpoints by (``peagle.rank``'s offline evaluation).
EvalFnFactory = Callable[[PipelineConfig, Path, str], Callable]


def rank_main(argv: list[str] | None = None, *, prog: str = f"python -m {RANK_MODULE}",
              make_eval_fn: EvalFnFactory | None = None) -> int:
    """What a rank runs: parse the launcher's arguments, load the config, train (evaluating
    through ``make_eval_fn``'s function, if given)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="pipeline config YAML")
    source.add_argument("--config-json", help="the pipeline config as JSON (inline, or a .json file)")
    parser.add_argument("--set", action="append", help="override a key of --config: train.recipe.epochs=3")
    parser.add_argument("--data-dir", required=True, type=Path, help="dataset directory (target_facts.json, splits/, vocab)")
    parser.add_argument("--target", required=True, help="the target model's local directory")
    parser.add_argument("--out", required=True, type=Path, help="checkpoint/metrics directory (resumed if it has one)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--no-resume", action="store_true", help="ignore checkpoints already in --out")
    parser.add_argument("--head-identity", help="the head's identity a resumed checkpoint must hold (the launcher's)")
    # The deepspeed launcher appends --local_rank=N; LOCAL_RANK in the environment is what is used.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)


    configure_environment()
    try:
        cfg = _load_cfg(args)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    from peagle.train.engine import flush_denormals
    from peagle.train.trainer import train_drafter

    flush_denormals()
    train_drafter(
        cfg,
        args.data_dir,
        args.target,
        args.out,
        progress=not args.no_progress,
        eval_fn=make_eval_fn(cfg, args.data_dir, args.target) if make_eval_fn else None,
        resume=not args.no_resume,
        identity=args.head_identity,
    )
    return 0


if __name__ == "__main__":
    sys.exit(rank_main())
