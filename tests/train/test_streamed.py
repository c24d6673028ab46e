"""A streamed dataset (data.hidden_states: streamed) trained as users run it: `peagle data` then
`peagle train`, the hidden states extracted by vLLM beside the ranks into a spool of a few
hundred KiB, sampled while it runs; the same samples, order and losses as the stored dataset
of the same config; and kill -9 mid-epoch, then a rerun that trains no sample twice."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from peagle.fileio import tree_bytes
from tests.peagle_cli import REPO, peagle
from tests.support.conversations import CONVERSATIONS

PROMPTS = CONVERSATIONS + [[{"role": "user", "content": f"Write a function that returns {i} times x."}]
                           for i in range(10)]  # 18 distinct conversations: 16 train, 2 held out

pytestmark = pytest.mark.slow

SPOOL_GIB = 0.001  # 1 MiB: chunks of 4 of the longest samples (64 tokens x 4 layers x 128 x bf16)
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
        "train": {"max_len": 64, "k_train": 3, "max_steps": STEPS, "save_every": 4, "micro_batch_size": 2, "optimizer": "adamw",
                  "precision": "fp32"},
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
            time.sleep(0.2)
        assert run.poll() is None, "training ended before it could be killed"
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    [head] = set(heads.glob("*")) - before
    return head


@pytest.mark.timeout(600)  # two data stages (~100 s), a stored training, a streamed one killed and rerun
def test_a_streamed_run_killed_and_rerun_trains_what_a_stored_run_does_with_a_spool_under_its_cap(datasets):
    """The streamed dataset keeps the train split's tokens only. Its training, killed -9 after step 5
    (checkpointed at step 4) and rerun, trains the stored run's samples in the stored run's order,
    each once per epoch, to the stored run's losses, while its spool stays under data.spool_gib."""
    streamed_train = run_dir(datasets["streamed"]) / "data" / "splits" / "train"
    manifest = json.loads((streamed_train / "manifest.json").read_text())
    stored_manifest = json.loads((run_dir(datasets["stored"]) / "data/splits/train/manifest.json").read_text())
    assert manifest["layer_ids"] == [] and manifest["num_samples"] == stored_manifest["num_samples"]
    assert manifest["bytes"] * 20 < stored_manifest["bytes"], "the streamed dataset keeps the train split's tokens only"

    assert peagle("train", datasets["stored"]).returncode == 0
    peak, done = [0], threading.Event()

    def sample_the_spool() -> None:
        while not done.is_set():
            for spool in (run_dir(datasets["streamed"]) / "checkpoints" / "peagle").glob("*/spool"):
                peak[0] = max(peak[0], tree_bytes(spool))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample_the_spool)
    sampler.start()
    try:
        head = train_killed_after(datasets["streamed"], 5)
        assert (head / "spool").exists(), "a killed run leaves its spool, which the rerun starts afresh"
        rerun_started = time.time()
        rerun = peagle("train", datasets["streamed"])
    finally:
        done.set()
        sampler.join()
    assert rerun.returncode == 0, rerun.output

    assert 0 < peak[0] <= SPOOL_GIB * 2**30, f"spool peaked at {peak[0]} bytes"
    assert not (head / "spool").exists(), "the spool is gone after training"
    stored, streamed = metrics(datasets["stored"]), metrics(datasets["streamed"])
    assert [r["step"] for r in streamed] == list(range(1, STEPS + 1))
    assert [r["step"] for r in streamed if r["time"] < rerun_started] == [1, 2, 3, 4], "resumed at the step-4 checkpoint"
    assert [r["samples"] for r in streamed] == [r["samples"] for r in stored]
    for a, b in zip(stored, streamed, strict=True):  # vLLM batches them differently: fp32 rounding apart
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a["step"], a["loss"], b["loss"])

    from peagle.data.order import BatchPlan
    from peagle.train.data import rank_order

    plan = BatchPlan(manifest["num_samples"], 1, 2, 1)
    expected = [i for epoch in range(2) for i in rank_order(plan, epoch, 0, 0)][: 2 * STEPS]
    assert [r["samples"] for r in streamed] == [sorted(expected[2 * s : 2 * s + 2]) for s in range(STEPS)]
    trained = [i for r in streamed for i in r["samples"]]
    assert plan.steps_per_epoch < STEPS and len(set(trained[: plan.read_per_epoch])) == plan.read_per_epoch
