"""A streamed dataset (data.hidden_states: streamed) trained as users run it: `peagle data` then
`peagle train`, the hidden states extracted by vLLM beside the ranks into a spool of a few
hundred KiB, sampled while it runs; the same samples, order and losses as the stored dataset
of the same config; and kill -9 mid-epoch, then a rerun that trains no sample twice. With a
spool the whole train split fits in, the second epoch reads the first one's extraction. Over
two "nodes" (two launchers meeting at a c10d rendezvous), one launcher extracts for both."""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from peagle.config import merge_settings
from peagle.fileio import tree_bytes
from tests.peagle_cli import REPO, peagle
from tests.processes import free_port
from tests.support.conversations import CONVERSATIONS

PROMPTS = CONVERSATIONS + [[{"role": "user", "content": f"Write a function that returns {i} times x."}]
                           for i in range(10)]  # 18 distinct conversations: 16 train, 2 held out

pytestmark = pytest.mark.slow

SPOOL_GIB = 0.0007  # 734 KiB: chunks of 2 of the longest samples (64 tokens x 4 layers x 128 x bf16), the split not whole
KEPT_SPOOL_GIB = 0.01  # 10 MiB: the whole train split (16 samples of at most 64 KiB each)
STEPS = 12  # of 2 samples each: over one epoch of the train split


def config(tmp: Path, target: Path, prompts: Path, hidden_states: str) -> Path:
    cfg = {
        "name": f"streamed-{hidden_states}",
        "workdir": str(tmp / hidden_states),
        "target": {"model": str(target), "dtype": "float32"},
        "vllm": {"max_model_len": 192, "max_num_seqs": 8, "cpu_kvcache_space_gib": 1},
        "data": {"sources": [{"kind": "jsonl", "path": str(prompts)}], "heldout_samples": 2, "min_tokens": 8,
                 "max_seq_len": 64, "aux_layer_ids": [1, 2, 3], "regenerate": {"max_tokens": 24, "batch_size": 4},
                 "shard_max_tokens": 256, "draft_vocab_size": 64, "extract_batch_size": 4,
                 "hidden_states": hidden_states, "spool_gib": SPOOL_GIB},
        "train": {"recipe": {"max_len": 64, "max_steps": STEPS, "micro_batch_size": 2, "batch_size": 2,
                             "optimizer": "adamw", "precision": "fp32"},
                  "peagle": {"k_train": 3}, "checkpoints": {"save_every": 4}},
        "eval": {"ks": [1, 2], "max_tokens": 16, "prompts": ["data/prompts/code_eval.jsonl"],
                 "offline_max_samples": 2},
    }
    path = tmp / f"{hidden_states}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """One tiny target, one prompt file, and `peagle data` of each kind: stored, streamed."""
    from peagle.testing.tiny import build_tiny_llama

    tmp = tmp_path_factory.mktemp("streamed")
    target = build_tiny_llama(tmp / "target")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": m}) + "\n" for m in PROMPTS))
    configs = {kind: config(tmp, target, prompts, kind) for kind in ("stored", "streamed")}
    for path in configs.values():
        built = peagle("data", path)
        assert built.returncode == 0, built.output
    return configs


def run_dir(config: Path) -> Path:
    return Path(yaml.safe_load(config.read_text())["workdir"])


def metrics(config: Path) -> list[dict]:
    [path] = (run_dir(config) / "checkpoints" / "peagle").glob("*/metrics.jsonl")
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


@dataclass
class SpoolWatch:
    peak: int = 0  # bytes
    chunks: set[str] = field(default_factory=set)  # every chunk directory seen


@contextmanager
def watching_spools(config: Path):
    """Samples the spools of ``config``'s P-EAGLE heads every 20 ms while the block runs."""
    watch, done = SpoolWatch(), threading.Event()

    def sample() -> None:
        while not done.is_set():
            for spool in (run_dir(config) / "checkpoints" / "peagle").glob("*/spool"):
                watch.peak = max(watch.peak, tree_bytes(spool))
                watch.chunks |= {p.name for p in spool.glob("e*-c*") if "." not in p.name}
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        yield watch
    finally:
        done.set()
        sampler.join()


def assert_trains_as_stored(stored: list[dict], streamed: list[dict]) -> None:
    assert [r["step"] for r in streamed] == list(range(1, STEPS + 1))
    assert [r["samples"] for r in streamed] == [r["samples"] for r in stored]
    for a, b in zip(stored, streamed, strict=True):  # vLLM batches them differently: fp32 rounding apart
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a["step"], a["loss"], b["loss"])


def streamed_dataset_in(workdir: Path, datasets: dict, **sections: dict) -> Path:
    """A config of its own run directory holding a copy of the streamed dataset, its sections
    merged with ``sections`` (as a config extends its base): another head on the same data, apart
    from the other tests' heads."""
    cfg = yaml.safe_load(datasets["streamed"].read_text())
    shutil.copytree(run_dir(datasets["streamed"]) / "data", workdir / "data")
    path = workdir.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(merge_settings(cfg, {"workdir": str(workdir), **sections})))
    return path


def train_killed_after(config: Path, step: int) -> Path:
    """`peagle train` as a process group, killed -9 (producer, vLLM engine, ranks) once its
    metrics show ``step``; the head directory it trained in."""
    heads = run_dir(config) / "checkpoints" / "peagle"
    before = set(heads.glob("*"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.Popen([sys.executable, "-m", "peagle.cli", "train", str(config)], cwd=REPO, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 400
    try:
        while time.monotonic() < deadline and run.poll() is None:
            new = [p / "metrics.jsonl" for p in set(heads.glob("*")) - before if (p / "metrics.jsonl").exists()]
            steps = [r.get("step", 0) for r in map(json.loads, new[0].read_text().splitlines())] if new else []
            if max(steps, default=0) >= step:
                break
            time.sleep(0.05)
        assert run.poll() is None, "training ended before it could be killed"
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    [head] = set(heads.glob("*")) - before
    return head


@pytest.mark.timeout(600)  # two data stages (~100 s), a stored training, a streamed one killed and rerun
def test_a_streamed_run_killed_and_rerun_trains_what_a_stored_run_does_with_a_spool_under_its_cap(datasets):
    """The streamed dataset keeps the train split's tokens only. Its training, killed -9 after step 5
    (checkpointed at step 4, or at 8 when the kill lands later) and rerun, trains the stored run's
    samples in the stored run's order, each once per epoch, to the stored run's losses, while its
    spool stays under data.spool_gib."""
    streamed_train = run_dir(datasets["streamed"]) / "data" / "splits" / "train"
    manifest = json.loads((streamed_train / "manifest.json").read_text())
    stored_manifest = json.loads((run_dir(datasets["stored"]) / "data/splits/train/manifest.json").read_text())
    assert manifest["layer_ids"] == [] and manifest["num_samples"] == stored_manifest["num_samples"]
    assert manifest["bytes"] * 20 < stored_manifest["bytes"], "the streamed dataset keeps the train split's tokens only"

    assert peagle("train", datasets["stored"]).returncode == 0
    with watching_spools(datasets["streamed"]) as spool:
        head = train_killed_after(datasets["streamed"], 5)
        assert (head / "spool").exists(), "a killed run leaves its spool, which the rerun starts afresh"
        rerun_started = time.time()
        rerun = peagle("train", datasets["streamed"])
    assert rerun.returncode == 0, rerun.output

    assert 0 < spool.peak <= SPOOL_GIB * 2**30, f"spool peaked at {spool.peak} bytes"
    assert any(name.startswith("e0001-") for name in spool.chunks), "the second epoch is extracted again"
    assert not (head / "spool").exists(), "the spool is gone after training"
    stored, streamed = metrics(datasets["stored"]), metrics(datasets["streamed"])
    assert_trains_as_stored(stored, streamed)
    from peagle.data.order import BatchPlan
    from peagle.train.data import rank_order

    plan = BatchPlan(manifest["num_samples"], 1, 2, 1)
    resumed_at = len([r for r in streamed if r["time"] < rerun_started])
    assert resumed_at in (4, 8), f"resumed at step {resumed_at}, not at a checkpoint after the kill (save_every 4)"
    if resumed_at < plan.steps_per_epoch:  # the rerun reads past the epoch it resumes in
        assert "each chunk deleted once read, every epoch extracted again" in rerun.output, rerun.output
    else:
        assert "each chunk deleted once read" in rerun.output and "every epoch" not in rerun.output, rerun.output
    expected = [i for epoch in range(2) for i in rank_order(plan, epoch, 0, 0)][: 2 * STEPS]
    assert [r["samples"] for r in streamed] == [sorted(expected[2 * s : 2 * s + 2]) for s in range(STEPS)]
    trained = [i for r in streamed for i in r["samples"]]
    assert plan.steps_per_epoch < STEPS and len(set(trained[: plan.read_per_epoch])) == plan.read_per_epoch


@pytest.mark.timeout(300)  # a stored training (reused when the test above trained it) and a streamed one
def test_a_train_split_that_fits_its_spool_is_extracted_once_for_every_epoch(datasets, tmp_path):
    """The streamed dataset trained with a spool that holds the whole train split: its 12 steps run
    into a second epoch, which reads the first one's chunks (no chunk of epoch 1 ever appears, the
    spool peaks at the whole split), to the stored run's losses; the spool is gone after."""
    kept = streamed_dataset_in(tmp_path / "kept", datasets, data={"spool_gib": KEPT_SPOOL_GIB})
    assert peagle("train", datasets["stored"]).returncode == 0
    with watching_spools(kept) as spool:
        trained = peagle("train", kept)
    assert trained.returncode == 0, trained.output
    assert "the whole split fits: extracted once and kept for every epoch" in trained.output, trained.output

    assert spool.chunks and all(name.startswith("e0000-") for name in spool.chunks), sorted(spool.chunks)
    tokens = json.loads((run_dir(kept) / "data/splits/train/manifest.json").read_text())["num_tokens"]
    whole = tokens * 4 * 128 * 2  # every sample's hidden states: 4 layers x 128 in bfloat16
    assert whole <= spool.peak <= KEPT_SPOOL_GIB * 2**30, (whole, spool.peak)
    assert not list((run_dir(kept) / "checkpoints" / "peagle").glob("*/spool")), "the spool is gone after training"
    assert_trains_as_stored(metrics(datasets["stored"]), metrics(kept))


def start_producer(config: Path) -> subprocess.Popen:
    """`peagle produce CONFIG` as an inference node runs it, its output (text) on a pipe."""
    return subprocess.Popen([sys.executable, "-m", "peagle.cli", "produce", str(config)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.timeout(400)  # a stored training (reused when a test above trained it) and two launchers of one run
def test_two_nodes_train_from_one_producer_and_read_what_a_stored_run_reads(datasets, tmp_path):
    """`peagle train` on two nodes (the same command on each: train.launch.nodes 2, one rank each): one
    launcher takes the spool's lock and extracts, the other says so and only starts its rank; both
    ranks mark what they read, so the spool stays under its cap; the steps train the stored run's
    samples (its global batch of 2 split 1 + 1 over the nodes), each once per epoch."""
    two_nodes = streamed_dataset_in(tmp_path / "two-nodes", datasets, train={
        "launch": {"nodes": 2, "world_size": 2, "rdzv_endpoint": f"127.0.0.1:{free_port()}"},
        "recipe": {"micro_batch_size": 1}})
    assert peagle("train", datasets["stored"]).returncode == 0
    outputs = {}

    def node(name: str) -> None:
        outputs[name] = peagle("train", two_nodes)

    with watching_spools(two_nodes) as spool:
        nodes = [threading.Thread(target=node, args=(name,)) for name in ("node-a", "node-b")]
        for thread in nodes:
            thread.start()
        for thread in nodes:
            thread.join()
    for name, result in outputs.items():
        assert result.returncode == 0, (name, result.output)
    said = sorted("hidden states extracted beside the ranks into" in r.output for r in outputs.values())
    assert said == [False, True], "exactly one launcher extracts"
    assert sum("another node's launcher extracts the hidden states" in r.output for r in outputs.values()) == 1

    assert 0 < spool.peak <= SPOOL_GIB * 2**30, f"spool peaked at {spool.peak} bytes"
    assert any(name.startswith("e0001-") for name in spool.chunks), "the second epoch is extracted again"
    assert not list((run_dir(two_nodes) / "checkpoints" / "peagle").glob("*/spool")), "the spool is gone after"
    records = metrics(two_nodes)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), "one writer: no step twice"
    assert [r["samples"] for r in records] == [r["samples"] for r in metrics(datasets["stored"])]


def start_training(config: Path) -> subprocess.Popen:
    """`peagle train CONFIG` in a process group of its own, as a terminal runs it."""
    return subprocess.Popen([sys.executable, "-m", "peagle.cli", "train", str(config)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def stop_after_first_step(training: subprocess.Popen, heads: Path) -> None:
    """Ctrl-C (SIGINT to its process group) once the training's ranks took a step."""
    deadline = time.monotonic() + 200
    while not any(p.read_text().strip() for p in heads.glob("*/metrics.jsonl")):
        assert time.monotonic() < deadline and training.poll() is None, "the training never took a step"
        time.sleep(0.1)
    os.killpg(training.pid, signal.SIGINT)  # what Ctrl-C in its terminal sends
    assert training.wait(timeout=60) != 0


@pytest.mark.timeout(500)  # a refusal, then a producer and a training twice: stopped, rerun to the end
def test_a_separate_producer_extracts_for_a_training_on_another_host_and_stops_with_it(datasets, tmp_path):
    """data.producer: separate, as an inference node and a training node run it on one run
    directory. Without a producer, `peagle train` stops after data.producer_wait_s, naming the
    command to run. With `peagle produce` running, Ctrl-C of the training once its ranks read
    what the producer writes: the training says where it stopped, and the producer, which would
    otherwise keep its engine for a training that no longer reads, stops too, removes its spool
    and says to rerun both. Rerun both: the training reads what the producer writes, to the
    stored run's losses, the spool under its cap; the producer ends once the training has, and
    the spool is gone."""
    from tests.peagle_cli import assert_refused

    separate = streamed_dataset_in(tmp_path / "separate", datasets, data={"producer": "separate",
                                                                          "producer_wait_s": 2})
    heads = run_dir(separate) / "checkpoints" / "peagle"
    assert_refused(peagle("train", separate), "data.producer: separate, but no `peagle produce` extracted",
                   "Run `peagle produce CONFIG`", "or set data.producer: launcher")
    assert not list(heads.glob("*/step-*")), "nothing trained"
    waiting = {"data": {**yaml.safe_load(separate.read_text())["data"], "producer_wait_s": 300}}
    separate.write_text(yaml.safe_dump({**yaml.safe_load(separate.read_text()), **waiting}))

    # 1. the training stopped: its producer stops too
    producer, training = start_producer(separate), start_training(separate)
    try:
        stop_after_first_step(training, heads)
        produced, _ = producer.communicate(timeout=60)
    finally:
        producer.kill()
        with contextlib.suppress(ProcessLookupError):  # the group is gone when it stopped as asked
            os.killpg(training.pid, signal.SIGKILL)
    produced = " ".join(produced.split())
    assert producer.returncode == 1, produced
    assert "separate producer: the training ended without a result; its spool is removed" in produced, produced
    assert "failed or was stopped: rerun `peagle train` and this command" in produced, produced
    [failed] = heads.glob("*/training_failed.txt")
    assert "KeyboardInterrupt" in failed.read_text()
    assert not list(heads.glob("*/spool")), "the spool is gone after"

    # 2. both rerun: the training ends, and then its producer
    assert peagle("train", datasets["stored"]).returncode == 0  # reused when a test above trained it
    with watching_spools(separate) as spool:
        producer = start_producer(separate)
        try:
            trained = peagle("train", separate)
            produced, _ = producer.communicate(timeout=120)
        finally:
            producer.kill()
    assert trained.returncode == 0, trained.output
    # from step 0, or from the checkpoint at step 4 where the stop landed after it
    assert re.search(r"the separate producer extracts from step [04] on", trained.output), trained.output
    assert producer.returncode == 0, produced
    produced = " ".join(produced.split())
    assert "separate producer: the training finished; its spool is removed" in produced, produced
    assert "chunk(s) of hidden states extracted beside training" in produced, produced

    assert 0 < spool.peak <= SPOOL_GIB * 2**30 and any(name.startswith("e0001-") for name in spool.chunks)
    assert not list(heads.glob("*/spool")), "the spool is gone after"
    assert_trains_as_stored(metrics(datasets["stored"]), metrics(separate))


PRODUCE_POOL, PRODUCE_DEPLOYMENT = "peagle-process", "produce"


def produce_runs() -> list:
    """The flow runs of the produce flow on the session's server, oldest first (a run takes its
    name, "produce-peagle <config> (<target>)", only once it starts)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["peagle-produce"])))
    return sorted(runs, key=lambda r: r.created)


@pytest.mark.timeout(420)  # a worker, a producer run cancelled while it starts, one that extracts beside a training
def test_the_train_flow_runs_its_producer_on_a_worker_of_the_produce_deployment(datasets, tmp_path, prefect_server):
    """data.producer: separate as Prefect users run it: the session's real server, prefect.yaml's
    produce deployment and a real process worker of its pool (the inference node). The train
    flow, run here, starts the producer's flow run on the worker and trains beside it, to the
    stored run's losses, and that run completes once the training has. A producer whose training
    failed stops, its run cancelled, and frees its accelerator slot. Before either: refused
    without the deployment, without a worker online, and with an accelerator limit of one slot
    (the producer would queue behind its training)."""
    from prefect.client.orchestration import get_client

    from flows.stages import train_flow
    from tests.prefect_worker import (
        deployed_on_this_server,
        logs_of_finished_runs,
        prefect_cli,
        prefect_worker,
        wait_for_flow_run,
        wait_for_online_workers,
        worker_env,
    )

    orchestration = {"accelerator_limit": "peagle-accelerator-produce", "accelerator_slots": 2}
    separate = streamed_dataset_in(tmp_path / "flow", datasets, data={"producer": "separate", "producer_wait_s": 300},
                                   orchestration=orchestration)
    unproduced = streamed_dataset_in(tmp_path / "unproduced", datasets, orchestration=orchestration,
                                     data={"producer": "separate", "producer_wait_s": 1})
    one_slot = {"orchestration.accelerator_limit": "peagle-accelerator-one-slot",
                "orchestration.accelerator_slots": 1}
    assert peagle("train", datasets["stored"]).returncode == 0  # reused when a test above trained it
    with deployed_on_this_server({PRODUCE_POOL}, {PRODUCE_DEPLOYMENT}):
        with pytest.raises(RuntimeError, match="does not have: deploy it .*or set data.producer: launcher"):
            train_flow(str(separate), export=False)
        env = worker_env(prefect_server, tmp_path)
        prefect_cli(["work-pool", "create", PRODUCE_POOL, "--type", "process"], env)
        prefect_cli(["--no-prompt", "deploy", "--name", PRODUCE_DEPLOYMENT], env, cwd=REPO)
        with pytest.raises(RuntimeError, match=f"no worker of the work pool '{PRODUCE_POOL}'.* online"):
            train_flow(str(separate), export=False)
        with prefect_worker(PRODUCE_POOL, env, tmp_path / "worker.log", cwd=REPO) as worker:
            wait_for_online_workers(PRODUCE_POOL, 1)
            with pytest.raises(RuntimeError, match="has 1: the producer would queue behind its own training"):
                train_flow(str(separate), overrides=one_slot, export=False)
            assert not produce_runs(), "refused before any producer run starts"

            with pytest.raises(Exception, match="no `peagle produce` extracted"):  # its producer is not up in 1 s
                train_flow(str(unproduced), export=False)
            [cancelled] = produce_runs()
            assert wait_for_flow_run(cancelled.id, timeout_s=120, poll_s=1, worker=worker).state.is_cancelled()

            with watching_spools(separate) as spool:
                trained = train_flow(str(separate), export=False)
            _, produced = produce_runs()
            produced = wait_for_flow_run(produced.id, timeout_s=60, poll_s=1, worker=worker)
            with get_client(sync_client=True) as client:  # while the worker runs: its run ships the last lines
                said = " ".join(r.message for r in logs_of_finished_runs(client, [produced.id]))
    assert produced.state.is_completed(), produced.state
    assert produced.name.startswith("produce-peagle streamed-streamed ("), produced.name
    assert "chunk(s) of hidden states extracted beside training" in said, said
    assert "separate producer: the training finished; its spool is removed" in said, said
    assert 0 < spool.peak <= SPOOL_GIB * 2**30
    assert not list((run_dir(separate) / "checkpoints" / "peagle").glob("*/spool")), "the spool is gone after"
    assert Path(trained.best_checkpoint).exists()
    assert_trains_as_stored(metrics(datasets["stored"]), metrics(separate))
