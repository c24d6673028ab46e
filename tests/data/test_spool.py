"""The spool of a streamed dataset: producer and ranks agree on the order, the cap holds, chunks
are deleted once read (or, when the whole split fits, extracted once and kept for every epoch),
and a failed or silent producer stops the ranks with its reason.

The producer here extracts with a deterministic function of the tokens (what vLLM's extraction
is to these tests: any function the ranks can check); the end-to-end tests in vLLM are in
tests/train/test_streamed.py."""

import os
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from peagle.data import spool as spool_mod
from peagle.data.spool import (
    ProducerStopped,
    SpooledSamples,
    SpoolPlan,
    chunk_samples_for,
    keeps_whole_split,
    producer_lock,
    producing,
    start_spool,
)
from peagle.data.store import ShardReader, ShardWriter, bytes_per_token
from peagle.fileio import write_json_atomic
from peagle.train.data import BatchPlan, rank_order

LAYERS, HT, DTYPE = [1, 2], 8, "float32"
REPO = Path(__file__).resolve().parents[2]


def hidden_of(ids: list[int]) -> torch.Tensor:
    """What 'extraction' returns for a sequence: [T, 2 layers, 8], readable back from the tokens."""
    t = torch.tensor(ids, dtype=torch.float32)
    return (t[:, None, None] + torch.arange(len(LAYERS) * HT, dtype=torch.float32).view(1, len(LAYERS), HT)) / 100


def extract(sequences):
    for sample_id, ids in sequences:
        yield sample_id, hidden_of(ids)


@pytest.fixture
def tokens(tmp_path):
    """A token-only train split of 26 samples, 5-40 tokens each."""
    g = torch.Generator().manual_seed(0)
    with ShardWriter(tmp_path / "train", [], HT, DTYPE, shard_max_tokens=200) as w:
        for i in range(26):
            n = int(torch.randint(5, 41, (1,), generator=g))
            w.add(f"s{i}", torch.randint(0, 50, (n,), generator=g), torch.ones(n, dtype=torch.bool), torch.empty(n, 0, HT))
    return ShardReader(tmp_path / "train")


def plan_for(tokens, cap, **kw) -> SpoolPlan:
    longest = max(tokens.lengths())
    fields = dict(num_samples=len(tokens), seed=3, world_size=2, micro_batch_size=2, grad_accum=1,
                  chunk_samples=chunk_samples_for(cap, longest, bytes_per_token(len(LAYERS), HT, DTYPE), len(tokens)),
                  start_step=0, total_steps=None)
    return SpoolPlan(**{**fields, **kw})


def read_as_ranks(root, tokens, plan: SpoolPlan, epochs: range, errors: list, first_step: int = 0) -> dict:
    """Each rank reads its order of every epoch (as the trainer's loader does); (rank, epoch) -> samples."""
    got, batches = {}, BatchPlan(plan.num_samples, plan.world_size, plan.micro_batch_size, plan.grad_accum)

    def rank(r: int) -> None:
        try:
            samples = SpooledSamples(tokens, root, r, poll_s=0.01)
            for epoch in epochs:
                samples.set_epoch(epoch)
                order = rank_order(batches, epoch, plan.seed, r)
                skip = first_step * batches.samples_per_step if epoch == epochs[0] else 0
                got[r, epoch] = [(i, samples[i]) for i in order[skip:]]
        except Exception as err:  # noqa: BLE001 - the test asserts on it
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(plan.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return got


def counting(extract_fn, counts: Counter):
    def extract_counted(sequences):
        for sample_id, hidden in extract_fn(sequences):
            counts[sample_id] += 1
            yield sample_id, hidden
    return extract_counted


def recording_chunks(monkeypatch) -> list:
    """(epoch, chunk) of every chunk the producer writes, in order."""
    written, real_write = [], spool_mod._write_chunk

    def recording_write(spool_, epoch, chunk, *args):
        written.append((epoch, chunk))
        return real_write(spool_, epoch, chunk, *args)

    monkeypatch.setattr(spool_mod, "_write_chunk", recording_write)
    return written


def test_ranks_read_every_sample_of_two_epochs_in_order_and_the_spool_stays_under_its_cap(tmp_path, tokens):
    cap = 3 * spool_mod.chunk_bytes(3 * 40, bytes_per_token(len(LAYERS), HT, DTYPE))  # three chunks of three of the longest
    plan = plan_for(tokens, cap, total_steps=2 * BatchPlan(26, 2, 2, 1).steps_per_epoch)
    assert plan.chunk_samples == 3
    root = tmp_path / "spool"
    spool = start_spool(root, plan)
    peak, done, errors = [0], threading.Event(), []

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], spool.bytes_used())
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    with producing(spool, tokens, extract, LAYERS, HT, DTYPE, cap):
        got = read_as_ranks(root, tokens, plan, range(2), errors)
    done.set()
    watcher.join()
    assert not errors, errors
    for (r, epoch), samples in got.items():
        assert [i for i, _ in samples] == rank_order(BatchPlan(26, 2, 2, 1), epoch, 3, r)
        for i, sample in samples:
            assert sample.id == tokens[i].id
            assert torch.equal(sample.token_ids, tokens[i].token_ids)
            assert torch.equal(sample.hidden, hidden_of(tokens[i].token_ids.tolist()))
    assert 0 < peak[0] <= cap, (peak[0], cap)
    assert not root.exists(), "the spool is removed once training is done"


def test_a_resumed_run_is_produced_from_its_checkpoint_position(tmp_path, tokens, monkeypatch):
    """Resumed at step 4 of an epoch of 6: production starts at the chunk holding its first sample,
    and the ranks read exactly the samples from there on."""
    cap = 1 << 20
    plan = plan_for(tokens, cap, start_step=4, total_steps=6, chunk_samples=4)
    root = tmp_path / "spool"
    spool = start_spool(root, plan)
    written, errors = recording_chunks(monkeypatch), []
    with producing(spool, tokens, extract, LAYERS, HT, DTYPE, cap):
        got = read_as_ranks(root, tokens, plan, range(1), errors, first_step=4)
    assert not errors, errors
    assert written == [(0, 4), (0, 5)]  # positions 16-23 of epoch 0: steps 4 and 5 of 4 samples each
    order = rank_order(BatchPlan(26, 2, 2, 1), 0, 3, 0)
    assert [i for i, _ in got[0, 0]] == order[8:]


def test_a_split_that_fits_the_cap_is_extracted_once_and_kept_for_every_epoch(tmp_path, tokens, monkeypatch):
    """Three epochs of 26 samples (each epoch reads 24: the two it leaves come up in others) from
    one extraction of each sample, laid out in the first epoch's order and never deleted."""
    cap = 1 << 20
    per_token = bytes_per_token(len(LAYERS), HT, DTYPE)
    plan = plan_for(tokens, cap, chunk_samples=4)
    assert keeps_whole_split(plan, tokens.lengths(), per_token, cap)
    plan = replace(plan, kept=True)
    root, counts, errors = tmp_path / "spool", Counter(), []
    written = recording_chunks(monkeypatch)
    spool = start_spool(root, plan)
    with producing(spool, tokens, counting(extract, counts), LAYERS, HT, DTYPE, cap):
        got = read_as_ranks(root, tokens, plan, range(3), errors)
        kept = sorted(p.name for p in spool.chunks())
    assert not errors, errors
    assert counts == Counter({tokens[i].id: 1 for i in range(26)}), "every sample extracted exactly once"
    assert written == [(0, c) for c in range(7)] and kept == [f"e0000-c{c:06d}" for c in range(7)]
    for (r, epoch), samples in got.items():
        assert [i for i, _ in samples] == rank_order(BatchPlan(26, 2, 2, 1), epoch, 3, r)
        for i, sample in samples:
            assert sample.id == tokens[i].id
            assert torch.equal(sample.hidden, hidden_of(tokens[i].token_ids.tolist()))
    assert len(got) == 6 and not root.exists(), "the kept spool is removed once training is done"


def test_a_resumed_kept_spool_starts_at_its_checkpoint_and_extracts_the_samples_before_it_last(
        tmp_path, tokens, monkeypatch):
    """Resumed at step 4 of epoch 0: the chunks from the one holding step 4's samples come first,
    then the ones before it (epoch 1 reads them), each once; the ranks read epoch 0's rest and epoch 1."""
    cap = 1 << 20
    plan = plan_for(tokens, cap, start_step=4, chunk_samples=4, kept=True)
    root, errors = tmp_path / "spool", []
    written = recording_chunks(monkeypatch)
    with producing(start_spool(root, plan), tokens, extract, LAYERS, HT, DTYPE, cap):
        got = read_as_ranks(root, tokens, plan, range(2), errors, first_step=4)
    assert not errors, errors
    assert written == [(0, 4), (0, 5), (0, 6), (0, 0), (0, 1), (0, 2), (0, 3)]
    order = rank_order(BatchPlan(26, 2, 2, 1), 1, 3, 1)
    assert [i for i, _ in got[1, 1]] == order
    assert all(torch.equal(s.hidden, hidden_of(tokens[i].token_ids.tolist())) for i, s in got[1, 1])


def test_a_spool_is_kept_only_when_the_whole_split_fits_and_a_later_epoch_reads_it(tokens):
    per_token = bytes_per_token(len(LAYERS), HT, DTYPE)
    whole = sum(tokens.lengths()) * per_token
    fits, short = whole + 7 * spool_mod.CHUNK_OVERHEAD_BYTES, whole + 6 * spool_mod.CHUNK_OVERHEAD_BYTES
    steps = BatchPlan(26, 2, 2, 1).steps_per_epoch  # 6
    assert keeps_whole_split(plan_for(tokens, 1 << 20, chunk_samples=4, total_steps=steps + 1), tokens.lengths(),
                             per_token, fits)
    assert not keeps_whole_split(plan_for(tokens, 1 << 20, chunk_samples=4, total_steps=steps + 1),
                                 tokens.lengths(), per_token, short), "all but one chunk fit"
    assert not keeps_whole_split(plan_for(tokens, 1 << 20, chunk_samples=4, total_steps=steps), tokens.lengths(),
                                 per_token, fits), "training ends with its first epoch: nothing is read twice"
    assert keeps_whole_split(plan_for(tokens, 1 << 20, chunk_samples=4, start_step=steps - 1, total_steps=steps + 1),
                             tokens.lengths(), per_token, fits), "resumed in epoch 0, reading into epoch 1"
    assert not keeps_whole_split(plan_for(tokens, 1 << 20, chunk_samples=4, start_step=steps, total_steps=2 * steps),
                                 tokens.lengths(), per_token, fits), "resumed in epoch 1, ending with it"


def test_a_failing_producer_stops_the_ranks_with_its_error(tmp_path, tokens):
    plan = plan_for(tokens, 1 << 20)
    root = tmp_path / "spool"
    spool = start_spool(root, plan)

    def broken(sequences):
        raise RuntimeError("the engine died")
        yield  # a generator, as extraction is

    errors = []
    with pytest.raises(RuntimeError, match="the engine died"):
        with producing(spool, tokens, broken, LAYERS, HT, DTYPE, 1 << 20):
            read_as_ranks(root, tokens, plan, range(1), errors)
    assert errors and all(isinstance(e, ProducerStopped) for e in errors)
    assert "the hidden-state producer failed: RuntimeError: the engine died" in str(errors[0])


def test_a_rank_gives_up_when_the_producer_goes_silent(tmp_path, tokens, monkeypatch):
    """kill -9 of the process that produces leaves the ranks waiting on a heartbeat that stopped:
    they stop with the reason and the fix (rerun: training resumes from its checkpoint)."""
    monkeypatch.setattr(spool_mod, "PRODUCER_SILENT_S", 0.2)
    plan = plan_for(tokens, 1 << 20)
    spool = start_spool(tmp_path / "spool", plan)
    (spool.root / spool_mod.HEARTBEAT_FILE).touch()
    time.sleep(0.3)
    samples = SpooledSamples(tokens, spool.root, 0, poll_s=0.01)
    with pytest.raises(ProducerStopped, match="rerun the same command: training resumes from its last checkpoint"):
        samples[rank_order(BatchPlan(26, 2, 2, 1), 0, 3, 0)[0]]


def test_a_chunk_is_at_most_a_third_of_the_cap_and_an_eighth_of_the_split():
    """The first chunk is what training waits for: a cap that holds the whole split still streams it."""
    per_token = bytes_per_token(len(LAYERS), HT, DTYPE)
    assert chunk_samples_for(1 << 30, 40, per_token, 26) == 4  # ceil(26 / 8), not the ~5 million that fit
    assert chunk_samples_for(1 << 30, 40, per_token, 5) == 1
    assert chunk_samples_for(3 * spool_mod.chunk_bytes(3 * 40, per_token), 40, per_token, 10_000) == 3


def test_a_rank_reads_the_plan_of_its_own_run_not_one_an_earlier_run_left(tmp_path, tokens, monkeypatch):
    """Another node can see an earlier run's plan for a moment on a shared filesystem: a rank that
    resumes at step 4 waits for the plan that starts there; one that never shows stops it, naming both."""
    stale = plan_for(tokens, 1 << 20, start_step=0)
    spool = start_spool(tmp_path / "spool", stale)
    got = {}
    rank = threading.Thread(target=lambda: got.update(
        plan=SpooledSamples(tokens, spool.root, 0, start_step=4, poll_s=0.01).plan))
    rank.start()
    time.sleep(0.3)
    assert rank.is_alive(), "it waits for its own run's plan"
    write_json_atomic(spool.plan_file, asdict(replace(stale, start_step=4)))
    rank.join(timeout=10)
    assert got["plan"].start_step == 4
    monkeypatch.setattr(spool_mod, "PRODUCER_SILENT_S", 0.2)
    with pytest.raises(ProducerStopped, match="plans from step 4 but this rank resumes at step 8"):
        SpooledSamples(tokens, spool.root, 0, start_step=8, poll_s=0.01)


def test_a_spool_nobody_produces_and_a_cap_too_small_are_refused_with_the_fix(tmp_path, tokens):
    with pytest.raises(ProducerStopped, match="trains through `peagle train` or the train flow"):
        SpooledSamples(tokens, tmp_path / "nothing", 0)
    with pytest.raises(ValueError, match="raise data.spool_gib to at least"):
        chunk_samples_for(1000, 40, bytes_per_token(2, 4096, "bfloat16"), 100)


def test_a_chunk_appears_whole_or_not_at_all(tmp_path, tokens):
    """A producer that dies while writing a chunk leaves only a temp directory: no rank reads it,
    and the next run's spool starts empty."""
    plan = plan_for(tokens, 1 << 20)
    spool = start_spool(tmp_path / "spool", plan)

    def dies_half_way(sequences):
        for k, (sample_id, ids) in enumerate(sequences):
            if k == 2:
                raise KeyboardInterrupt  # what a kill looks like from inside the writer: the block never finishes
            yield sample_id, hidden_of(ids)

    with pytest.raises(KeyboardInterrupt):
        spool_mod._write_chunk(spool, 0, 0, [tokens[i] for i in range(5)], dies_half_way, LAYERS, HT, DTYPE)
    assert spool.chunks() == [] and not spool.chunk(0, 0).exists()
    start_spool(spool.root, plan)
    assert sorted(p.name for p in spool.root.iterdir()) == ["plan.json"]


def test_one_launcher_holds_the_producer_lock_and_a_killed_holder_releases_it(tmp_path):
    """What decides which node's launcher extracts: the first to take the lock; kill -9 frees it."""
    holds = ("import sys, time\nfrom peagle.data.spool import producer_lock\n"
             "with producer_lock(sys.argv[1]) as held:\n    print(held, flush=True)\n    time.sleep(120)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen([sys.executable, "-c", holds, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "True"
        with producer_lock(tmp_path) as held:
            assert not held, "another process holds it"
    finally:
        holder.kill()
        holder.wait()
    with producer_lock(tmp_path) as held:
        assert held, "released by the kill"
