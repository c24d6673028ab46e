"""A streamed train split: hidden states extracted beside training into a bounded spool.

A dataset built with ``data.hidden_states: streamed`` stores the train split's tokens only
(its manifest lists no layers). While a head trains, a producer in the stage's process
extracts the hidden states of the samples training reads next, with one vLLM extraction
engine, in exactly the order the ranks read them (``peagle.data.order``), and writes them as
chunks into the spool directory; each rank reads a chunk when its samples come up and marks
it read; the producer deletes a chunk once every rank has read it and writes the next only
when it fits under the cap (``data.spool_gib``). Every epoch is extracted again, unless the
whole split fits under the cap and training reads past the epoch it starts in: then the
spool is *kept* (``SpoolPlan.kept``): the producer extracts every sample once, laid out in
the first epoch's order, nothing is marked or deleted, and later epochs read their samples
from those chunks. Either way the spool is removed when training ends.

Layout of a spool directory::

    plan.json               what producer and ranks agree on: samples, seed, batch plan, chunk size
    e0002-c000013/          one chunk: a split directory of the shard store (manifest, checksummed
                            shards), published whole (built under a temp name, then renamed)
    e0002-c000013.read-r1   rank 1 has read everything of that chunk it needs
    heartbeat               touched by the producer every few seconds while it runs
    failed                  the producer's error, when it stopped on one

One producer serves the ranks of every node: the launcher that holds the head directory's
``spool.lock`` (``producer_lock``). With ``train.launch.nodes`` > 1 each node's launcher tries to take
it; the one that does extracts, the others only start their ranks, which read the spool on
the filesystem every node shares.

A rank that waits for a chunk gives up with a clear error when the producer failed or its
heartbeat stops. A producer killed mid-chunk leaves only a temp directory, which the next
producer removes with the rest of the spool: the spool holds nothing a rerun trusts, and a
rerun resumes from the trainer's last checkpoint.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from peagle.data.order import BatchPlan, epoch_permutation
from peagle.data.store import Sample, ShardReader, ShardWriter, bytes_per_token, format_bytes
from peagle.fileio import staged_dir, tree_bytes, write_json_atomic, write_text_atomic
from peagle.layout import MANIFEST_FILE

log = logging.getLogger(__name__)

PLAN_FILE = "plan.json"
LOCK_FILE = "spool.lock"  # beside the spool, in the head directory: held by the launcher that produces
HEARTBEAT_FILE = "heartbeat"
FAILED_FILE = "failed"
HEARTBEAT_EVERY_S = 2.0
PRODUCER_SILENT_S = 120.0  # a rank waiting this long with no heartbeat gives up
CHUNKS_UNDER_CAP = 3  # a chunk is at most a third of the cap: one read, one written, one ahead
MIN_CHUNKS_PER_EPOCH = 8  # and at most an eighth of the split: training starts after the first
CHUNK_OVERHEAD_BYTES = 64 << 10  # a chunk's safetensors header (its sample ids) and manifest, generously

Extract = Callable[[list[tuple[str, list[int]]]], Iterable[tuple[str, torch.Tensor]]]


class ProducerStopped(RuntimeError):
    """The hidden-state producer a rank waits on failed or went silent."""


def is_streamed(split_dir: str | Path) -> bool:
    """A split stored as tokens only: its hidden states come from a spool while training."""
    return json.loads((Path(split_dir) / MANIFEST_FILE).read_text()).get("layer_ids") == []


@dataclass(frozen=True)
class SpoolPlan:
    """What the producer writes and the ranks read, fixed before either starts."""

    num_samples: int  # the first num_samples of the train split (train.recipe.max_samples)
    seed: int  # train.recipe.seed: the epoch permutation's
    world_size: int
    micro_batch_size: int
    grad_accum: int
    chunk_samples: int
    start_step: int  # the trainer's resume point: production starts at its first sample
    total_steps: int | None  # None: until training stops (a time budget)
    kept: bool = False  # every sample extracted once and kept for later epochs (``keeps_whole_split``)

    @property
    def batches(self) -> BatchPlan:
        return BatchPlan(self.num_samples, self.world_size, self.micro_batch_size, self.grad_accum)

    @property
    def laid_out(self) -> int:
        """Entries of an epoch's permutation its chunks hold: the ones that epoch reads, or, kept,
        the whole split (a later epoch reads the tail the first one leaves short of a step)."""
        return self.num_samples if self.kept else self.batches.read_per_epoch

    @property
    def chunks_per_epoch(self) -> int:
        return math.ceil(self.laid_out / self.chunk_samples)

    @property
    def reads_again(self) -> bool:
        """Training reads on past the epoch it starts in, so some sample is read a second time."""
        end = self.end()
        return end is None or end > (self.start()[0] + 1, 0)

    def chunk_of(self, position: int) -> int:
        return position // self.chunk_samples

    def start(self) -> tuple[int, int]:
        """(epoch, position in its permutation) of the first sample training reads."""
        epoch, step = divmod(self.start_step, self.batches.steps_per_epoch)
        return epoch, step * self.batches.samples_per_global_step

    def end(self) -> tuple[int, int] | None:
        """(epoch, position) one past the last sample training reads; None when open-ended."""
        if self.total_steps is None:
            return None
        epoch, step = divmod(self.total_steps, self.batches.steps_per_epoch)
        return epoch, step * self.batches.samples_per_global_step

    def chunk_positions(self, chunk: int) -> range:
        return range(chunk * self.chunk_samples, min((chunk + 1) * self.chunk_samples, self.laid_out))


def chunk_bytes(num_tokens: int, bytes_per_token_: int) -> int:
    """What a chunk of ``num_tokens`` tokens takes in the spool, its headers and manifest included."""
    return num_tokens * bytes_per_token_ + CHUNK_OVERHEAD_BYTES


def chunk_samples_for(cap_bytes: int, longest_tokens: int, bytes_per_token_: int, num_samples: int) -> int:
    """Samples per chunk: as many of the longest as fit in a third of the cap, and at most an
    eighth of the split's ``num_samples`` (the first chunk is what training waits for before its
    first step, so a cap that holds a whole epoch still streams it); refuses a cap too small for
    one of the longest (``ValueError`` naming ``data.spool_gib``)."""
    per_sample = longest_tokens * bytes_per_token_
    fit = (cap_bytes // CHUNKS_UNDER_CAP - CHUNK_OVERHEAD_BYTES) // max(1, per_sample)
    if fit < 1:
        least = CHUNKS_UNDER_CAP * chunk_bytes(longest_tokens, bytes_per_token_)
        raise ValueError(
            f"data.spool_gib ({format_bytes(cap_bytes)}) cannot hold {CHUNKS_UNDER_CAP} chunks of the longest "
            f"sample ({longest_tokens} tokens, {format_bytes(per_sample)} of hidden states): raise data.spool_gib to "
            f"at least {math.ceil(least / 2**30 * 1000) / 1000} GiB"
        )
    return int(min(fit, max(1, math.ceil(num_samples / MIN_CHUNKS_PER_EPOCH))))


def keeps_whole_split(plan: SpoolPlan, lengths: Sequence[int], bytes_per_token_: int, cap_bytes: int) -> bool:
    """Whether ``plan``'s spool is kept: training reads a sample twice (a later epoch) and every
    sample's hidden states (``lengths``, in tokens) fit under ``cap_bytes`` at once, so one
    extraction serves every epoch."""
    chunks = math.ceil(plan.num_samples / plan.chunk_samples)
    whole = sum(lengths[: plan.num_samples]) * bytes_per_token_ + chunks * CHUNK_OVERHEAD_BYTES
    return plan.reads_again and whole <= cap_bytes


class Spool:
    """The files of one spool directory (see the module doc)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def chunk(self, epoch: int, chunk: int) -> Path:
        return self.root / f"e{epoch:04d}-c{chunk:06d}"

    def read_mark(self, epoch: int, chunk: int, rank: int) -> Path:
        return self.root / f"{self.chunk(epoch, chunk).name}.read-r{rank}"

    @property
    def plan_file(self) -> Path:
        return self.root / PLAN_FILE

    def plan(self) -> SpoolPlan:
        return SpoolPlan(**json.loads(self.plan_file.read_text()))

    def chunks(self) -> list[Path]:
        """Published chunks, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and p.name.startswith("e") and "." not in p.name)

    def bytes_used(self) -> int:
        return tree_bytes(self.root)

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def producer_problem(self) -> str | None:
        """Why the producer will write nothing more, or None while it runs."""
        failed = self.root / FAILED_FILE
        if failed.exists():
            return f"the hidden-state producer failed: {failed.read_text().strip()}"
        silent = self.heartbeat_age()
        if silent is None:
            return None  # not started yet: the plan exists, so it is starting
        if silent > PRODUCER_SILENT_S:
            return (f"the hidden-state producer stopped ({self.root / HEARTBEAT_FILE} not touched for {silent:.0f} s); "
                    "rerun the same command: training resumes from its last checkpoint")
        return None

    def heartbeat_age(self) -> float | None:
        """Seconds since the producer's last heartbeat; None before its first."""
        try:
            return time.time() - (self.root / HEARTBEAT_FILE).stat().st_mtime
        except FileNotFoundError:
            return None


# ----------------------------------------------------------------------------- producer side


@contextmanager
def producer_lock(head_dir: str | Path) -> Iterator[bool]:
    """Whether this process is the one that produces ``head_dir``'s spool: True while it holds an
    exclusive ``flock`` on ``head_dir/spool.lock``, False when another process does. The OS
    releases the lock when its holder dies (kill -9 included), also on a shared filesystem that
    supports locks (NFSv4; Lustre mounted with ``flock``), so a rerun never waits on a dead one."""
    Path(head_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(head_dir) / LOCK_FILE, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = True
        except BlockingIOError:
            held = False
        try:
            yield held
        finally:
            if held:
                fcntl.flock(lock, fcntl.LOCK_UN)


def start_spool(root: str | Path, plan: SpoolPlan) -> Spool:
    """A fresh spool for ``plan``: whatever an earlier (killed) run left is removed first."""
    spool = Spool(root)
    spool.clear()
    spool.root.mkdir(parents=True)
    write_json_atomic(spool.plan_file, asdict(plan))
    return spool


def produce(spool: Spool, tokens: Sequence[Sample], extract: Extract, layer_ids: list[int], hidden_size: int,
            storage_dtype: str, cap_bytes: int, stop: threading.Event) -> int:
    """Write the chunks training reads, in its order, under ``cap_bytes``; returns chunks written.

    ``tokens``: the train split's token-only samples (index = sample index); ``extract(sequences)``
    yields ``(sample id, hidden [T, len(layer_ids), Ht])`` per ``(id, token ids)``, in order.
    Stops when the plan's last step is written or ``stop`` is set.
    """
    plan = spool.plan()
    if plan.kept:
        return _produce_once(spool, plan, tokens, extract, layer_ids, hidden_size, storage_dtype, stop)
    epoch, position = plan.start()
    end = plan.end()
    written = 0
    while end is None or (epoch, position) < end:
        order = epoch_permutation(plan.num_samples, epoch, plan.seed)
        for chunk in range(plan.chunk_of(position), plan.chunks_per_epoch):
            if end is not None and (epoch, plan.chunk_positions(chunk).start) >= end:
                return written
            samples = [tokens[order[p]] for p in plan.chunk_positions(chunk)]
            need = chunk_bytes(sum(len(s.token_ids) for s in samples),
                               bytes_per_token(len(layer_ids), hidden_size, storage_dtype))
            if not _wait_for_room(spool, plan, need, cap_bytes, stop):
                return written
            _write_chunk(spool, epoch, chunk, samples, extract, layer_ids, hidden_size, storage_dtype)
            written += 1
            if stop.is_set():
                return written
        epoch, position = epoch + 1, 0
    return written


def _produce_once(spool: Spool, plan: SpoolPlan, tokens: Sequence[Sample], extract: Extract, layer_ids: list[int],
                  hidden_size: int, storage_dtype: str, stop: threading.Event) -> int:
    """A kept spool: every chunk of the first epoch's layout once, from the one training reads
    first round to the one before it (a resumed run's earlier samples come up in later epochs)."""
    epoch, position = plan.start()
    order = epoch_permutation(plan.num_samples, epoch, plan.seed)
    first = plan.chunk_of(position)
    written = 0
    for chunk in [*range(first, plan.chunks_per_epoch), *range(first)]:
        if stop.is_set():
            break
        samples = [tokens[order[p]] for p in plan.chunk_positions(chunk)]
        _write_chunk(spool, epoch, chunk, samples, extract, layer_ids, hidden_size, storage_dtype)
        written += 1
    return written


def _wait_for_room(spool: Spool, plan: SpoolPlan, need: int, cap_bytes: int, stop: threading.Event) -> bool:
    """Delete chunks every rank has read until ``need`` more bytes fit; False when stopped."""
    while True:
        delete_read_chunks(spool, plan.world_size)
        if spool.bytes_used() + need <= cap_bytes or not spool.chunks():
            return True
        if stop.wait(0.05):
            return False


def delete_read_chunks(spool: Spool, world_size: int) -> None:
    for chunk in spool.chunks():
        marks = [spool.root / f"{chunk.name}.read-r{r}" for r in range(world_size)]
        if all(m.exists() for m in marks):
            shutil.rmtree(chunk)
            for m in marks:
                m.unlink(missing_ok=True)


def _write_chunk(spool: Spool, epoch: int, chunk: int, samples: list[Sample], extract: Extract,
                 layer_ids: list[int], hidden_size: int, storage_dtype: str) -> None:
    by_id = {s.id: s for s in samples}
    with staged_dir(spool.chunk(epoch, chunk)) as tmp:
        with ShardWriter(tmp, layer_ids, hidden_size, storage_dtype, shard_max_tokens=1 << 40,
                         meta={"epoch": epoch, "chunk": chunk}) as writer:
            for sample_id, hidden in extract([(s.id, s.token_ids.tolist()) for s in samples]):
                s = by_id[sample_id]
                writer.add(sample_id, s.token_ids, s.loss_mask, hidden)
        (tmp / ".lock").unlink(missing_ok=True)
        missing = set(by_id) - set(ShardReader(tmp, verify=False).sample_ids())
        if missing:
            raise RuntimeError(f"extraction returned no hidden states for {len(missing)} sample(s) of chunk {chunk}")


@contextmanager
def producing(spool: Spool, tokens: Sequence[Sample], extract: Extract, layer_ids: list[int], hidden_size: int,
              storage_dtype: str, cap_bytes: int) -> Iterator[threading.Thread]:
    """Run ``produce`` in a thread (with its heartbeat) while the block trains; on leaving, stop
    it, raise its error if it failed, and remove the spool."""
    stop, errors, counts = threading.Event(), [], []

    def heartbeat() -> None:
        while not stop.wait(HEARTBEAT_EVERY_S):
            (spool.root / HEARTBEAT_FILE).touch()

    def run() -> None:
        try:
            counts.append(produce(spool, tokens, extract, layer_ids, hidden_size, storage_dtype, cap_bytes, stop))
        except BaseException as err:  # noqa: BLE001 - handed to the ranks through the spool and to the caller
            errors.append(err)
            # whole or not at all: a rank that sees the file reads the error, never an empty one
            write_text_atomic(spool.root / FAILED_FILE, f"{type(err).__name__}: {err}\n", durable=False)

    (spool.root / HEARTBEAT_FILE).touch()
    threads = [threading.Thread(target=heartbeat, name="spool-heartbeat", daemon=True),
               threading.Thread(target=run, name="spool-producer", daemon=True)]
    for t in threads:
        t.start()
    try:
        yield threads[1]
    finally:
        stop.set()
        for t in threads:
            t.join()
        spool.clear()
    if errors:
        raise errors[0]
    # from the caller's thread: a Prefect flow run's log takes records of its own threads only
    log.info("spool: %d chunk(s) of hidden states extracted beside training", counts[0] if counts else 0)


# ----------------------------------------------------------------------------- rank side


class SpooledSamples:
    """The train split as one rank sees it when streamed: tokens from the dataset, hidden
    states from the spool's chunks, which this rank marks read as it moves past them.

    Index ``i`` is a sample index, as with a ``ShardReader``; ``set_epoch`` says which
    epoch's chunks hold them (a kept spool's first epoch's, whichever epoch reads). Reads
    follow the rank's order (``peagle.train.data``)."""

    def __init__(self, tokens: Sequence[Sample], spool_dir: str | Path, rank: int, *, start_step: int | None = None,
                 poll_s: float = 0.05):
        self.tokens = tokens
        self.spool = Spool(spool_dir)
        self.rank = rank
        self.poll_s = poll_s
        self.plan = self._wait_for_plan(start_step)
        if self.plan.num_samples != len(tokens):
            raise ValueError(f"{self.spool.plan_file} is for {self.plan.num_samples} samples, this rank trains "
                             f"on {len(tokens)}: the spool belongs to another run")
        self.epoch = -1
        self._position: dict[int, int] = {}
        self._open: dict[int, tuple[ShardReader, dict[str, int]]] = {}  # chunk -> reader, sample id -> row
        self._unmarked = 0  # the first chunk of this epoch this rank has not marked read
        if self.plan.kept:
            self._layout_epoch = self.plan.start()[0]
            order = epoch_permutation(self.plan.num_samples, self._layout_epoch, self.plan.seed)
            self._position = {index: p for p, index in enumerate(order)}
        self.set_epoch(0)

    def __len__(self) -> int:
        return len(self.tokens)

    def set_epoch(self, epoch: int) -> None:
        if epoch == self.epoch or self.plan.kept:  # kept: every epoch reads the same chunks, none is marked
            self.epoch = epoch
            return
        if self.epoch >= 0:
            self._mark_read_until(self.plan.chunks_per_epoch)
        self.epoch = epoch
        self._layout_epoch = epoch
        order = epoch_permutation(self.plan.num_samples, epoch, self.plan.seed)
        self._position = {index: p for p, index in enumerate(order[: self.plan.batches.read_per_epoch])}
        self._open = {}
        self._unmarked = None  # set by the first read: a resumed epoch starts mid-way

    def __getitem__(self, index: int) -> Sample:
        position = self._position.get(index)
        if position is None:
            raise IndexError(f"sample {index} is not read in epoch {self.epoch} (the tail short of a step)")
        chunk = self.plan.chunk_of(position)
        if not self.plan.kept:
            if self._unmarked is None:  # the global position this epoch starts at (ranks read p = i * W + r)
                self._unmarked = self.plan.chunk_of(position - self.rank)
            self._mark_read_until(chunk)
        reader, ids = self._reader(chunk)
        return reader[ids[self.tokens[index].id]]

    def _reader(self, chunk: int) -> tuple[ShardReader, dict[str, int]]:
        """The chunk's reader, opened (and its checksums verified) once: a streamed rank keeps the
        one it reads, a kept spool's every chunk."""
        if chunk not in self._open:
            path = self.spool.chunk(self._layout_epoch, chunk)
            self._wait_for(path)
            reader = ShardReader(path, verify="full", remember_checks=False)
            if not self.plan.kept:
                self._open.clear()  # read once, then deleted
            self._open[chunk] = (reader, {sid: i for i, sid in enumerate(reader.sample_ids())})
        return self._open[chunk]

    def _mark_read_until(self, chunk: int) -> None:
        """Every chunk before ``chunk`` this epoch is done with, as far as this rank goes."""
        if self._unmarked is None:
            return
        for c in range(self._unmarked, chunk):
            self.spool.read_mark(self.epoch, c, self.rank).touch()
        self._unmarked = max(self._unmarked, chunk)

    def _wait_for_plan(self, start_step: int | None) -> SpoolPlan:
        """The producer's plan for this run: one that starts where this rank resumes
        (``start_step``). A plan an earlier run left can still be what another node sees of
        the shared filesystem for a moment (its cache), until the producer's new one shows."""
        if not self.spool.plan_file.exists():  # written before any rank starts
            raise ProducerStopped(
                f"{self.spool.plan_file} not found: a streamed dataset (data.hidden_states: streamed) trains through "
                "`peagle train` or the train flow, which extract its hidden states beside the ranks")
        deadline = time.monotonic() + PRODUCER_SILENT_S
        while True:
            try:
                plan = self.spool.plan()
            except FileNotFoundError:  # the producer is clearing the spool to start it afresh
                plan = None
            if plan is not None and (start_step is None or plan.start_step == start_step):
                return plan
            if time.monotonic() > deadline or self.spool.producer_problem():
                raise ProducerStopped(
                    f"{self.spool.plan_file} plans from step {plan.start_step if plan else '?'} but this rank resumes at "
                    f"step {start_step}: the spool is another run's; rerun the same command (training resumes from its "
                    "last checkpoint)")
            time.sleep(self.poll_s)

    def _wait_for(self, path: Path) -> None:
        while not path.exists():
            problem = self.spool.producer_problem()
            if problem and not path.exists():
                raise ProducerStopped(f"waiting for {path.name}: {problem}")
            time.sleep(self.poll_s)
