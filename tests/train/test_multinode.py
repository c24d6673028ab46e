"""Training over two "nodes" from the config, and resuming at another world size.

The nodes are two launchers on 127.0.0.1 meeting at a c10d rendezvous (gloo), one rank
each, started the way every node starts them: through the pipeline's training stage with
the same config. The reference is the single-node run with the same two ranks.
"""

from __future__ import annotations

import shutil
import sys
import threading
from pathlib import Path

import pytest
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))  # the tiny-run builders live in test_deepspeed.py
from test_deepspeed import (  # noqa: E402,F401 (fixtures)
    ONE_THREAD,
    build_tiny_dataset,
    build_tiny_target,
    one_thread,
    read_metrics,
    tiny_config,
    tiny_facts,
)

from peagle import checkpoint_format as fmt  # noqa: E402
from peagle.config import ConfigError  # noqa: E402
from peagle.identity import head_identity  # noqa: E402
from peagle.layout import LATEST  # noqa: E402
from tests.processes import free_port  # noqa: E402

SAMPLES = 16  # one epoch: 8 optimizer steps of a global batch of 2
RUN = dict(zero_stage=2, epochs=1, save_every=4, keep_last=4)


def losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def samples_by_step(records: list[dict]) -> dict[int, list[int]]:
    return {r["step"]: r["samples"] for r in records if "samples" in r}


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """(data_dir, target_dir) with an eval split: the training stage scores its checkpoints offline."""
    root = tmp_path_factory.mktemp("multinode")
    target = build_tiny_target(root / "target")
    return build_tiny_dataset(root / "data", target, num_samples=SAMPLES, num_eval=4), target


@pytest.fixture(scope="module")
def single_node(tiny_data, tmp_path_factory):
    """Two ranks on one node (torchrun --standalone): the trajectory every other layout must give."""
    from peagle.train.launch import launch_training

    data_dir, target = tiny_data
    out = tmp_path_factory.mktemp("single-node")
    return launch_training(tiny_config(world_size=2, **RUN), data_dir, str(target), out, progress=False, env=ONE_THREAD)


def test_launch_settings_are_checked_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match="needs train.launch.rdzv_endpoint"):
        tiny_config(world_size=2, nodes=2)
    with pytest.raises(ValueError, match="multiple of train.launch.nodes"):
        tiny_config(world_size=3, nodes=2, rdzv_endpoint="10.0.0.1:29400")
    with pytest.raises(ValueError, match="is not 'HOST:PORT'"):
        tiny_config(world_size=2, nodes=2, rdzv_endpoint="10.0.0.1")
    with pytest.raises(ValueError, match="set one"):
        tiny_config(world_size=2, nodes=2, rdzv_endpoint="a:1", hostfile="hosts")
    from peagle.train.launch import training_command

    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a slots=2\nnode-b slots=2\n")
    with pytest.raises(ConfigError, match="4 slots but train.launch.world_size is 2"):
        training_command(Path("c.json"), Path("d"), "t", Path("o"),
                         tiny_config(world_size=2, hostfile=str(hostfile)).train)
    cmd = training_command(Path("c.json"), Path("d"), "t", Path("/runs/x"),
                           tiny_config(world_size=4, nodes=2, rdzv_endpoint="10.0.0.1:29400").train)
    assert "--nnodes=2" in cmd and "--nproc_per_node=2" in cmd and "--rdzv_endpoint=10.0.0.1:29400" in cmd
    assert "--standalone" not in cmd


def test_launch_fields_and_the_split_of_the_batch_keep_the_head_identity():
    dataset = {"train": "aa"}
    two_ranks = head_identity(tiny_config(world_size=2, batch_size=2), dataset)
    assert head_identity(tiny_config(world_size=1, batch_size=2), dataset) == two_ranks
    assert head_identity(tiny_config(world_size=2, nodes=2, rdzv_endpoint="h:1", rdzv_id="job"), dataset) == two_ranks
    assert head_identity(tiny_config(world_size=1, batch_size=1), dataset) != two_ranks  # another global batch


@pytest.mark.parametrize("samples", [16, 23])
def test_a_step_trains_the_same_samples_however_the_batch_splits(samples):
    from peagle.train.data import BatchPlan, rank_order

    def steps(world_size: int, grad_accum: int, micro_batch_size: int) -> list[list[int]]:
        plan = BatchPlan(samples, world_size, micro_batch_size, grad_accum)
        per_step = plan.samples_per_step
        orders = [rank_order(plan, 3, 0, rank) for rank in range(world_size)]
        return [sorted(i for order in orders for i in order[s * per_step:(s + 1) * per_step])
                for s in range(plan.steps_per_epoch)]

    reference = steps(4, 1, 1)
    assert steps(2, 2, 1) == steps(1, 4, 1) == steps(1, 2, 2) == reference
    assert len(reference) == samples // 4 and len({i for step in reference for i in step}) == 4 * len(reference)


@pytest.mark.slow  # two torchrun launchers meeting at a c10d rendezvous, plus the single-node reference: ~90 s
def test_two_nodes_through_the_training_stage_match_one_node(tiny_data, single_node, tmp_path, monkeypatch):
    from peagle.stages import TargetInfo, checkpoint_dir, plan_head, train_head

    data_dir, target = tiny_data
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = tiny_config(world_size=2, nodes=2, rdzv_endpoint=f"127.0.0.1:{free_port()}", **RUN)
    cfg = cfg.model_copy(update={"workdir": str(tmp_path / "run")})
    info = TargetInfo(path=str(target), facts=tiny_facts())
    results, errors = {}, {}

    def node(name: str) -> None:  # what `peagle train CONFIG` does on each node
        try:
            results[name] = train_head(plan_head(cfg, None, data_dir), info)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors[name] = err

    nodes = [threading.Thread(target=node, args=(name,)) for name in ("node-a", "node-b")]
    for thread in nodes:
        thread.start()
    for thread in nodes:
        thread.join(timeout=600)
    assert not errors, errors
    a, b = results["node-a"], results["node-b"]
    assert a.to_json() == b.to_json()  # both nodes return rank 0's result

    out = checkpoint_dir(cfg, "peagle", data_dir)
    records = read_metrics(out)
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, 9))  # one writer: no step twice
    reference = losses(single_node.metrics_history)
    assert losses(records) == pytest.approx(reference, rel=1e-6, abs=1e-7)
    seen = [i for step in samples_by_step(records).values() for i in step]
    assert sorted(seen) == list(range(SAMPLES))  # each sample of the epoch exactly once
    assert samples_by_step(records) == samples_by_step(single_node.metrics_history)
    assert any("eval/acceptance" in r for r in records) and a.best_checkpoint is not None
    assert [p.name for p in fmt.list_checkpoints(out)] == ["step-000004", "step-000008"]
    written = sorted(p.name for p in a.last_checkpoint.iterdir())
    assert written == ["deepspeed", "drafter.safetensors", "head_spec.json", "optimizer.safetensors",
                       "rng-rank-1.json", "trainer_state.json"]  # rank 1 writes only its RNG state


def resume_from(checkpoint: Path, out: Path) -> Path:
    """A fresh output directory holding only ``checkpoint``, marked latest (a run stopped there)."""
    shutil.copytree(checkpoint, out / checkpoint.name)
    fmt.write_pointer(out, LATEST, checkpoint.name, step=fmt.checkpoint_step(checkpoint))
    return out


@pytest.mark.slow  # one more two-rank torchrun (plus the shared reference) and two single-rank runs: ~90 s
def test_resume_at_another_world_size_carries_optimizer_and_data_position(tiny_data, single_node, tmp_path):
    from peagle.train.launch import launch_training
    from peagle.train.trainer import train_drafter

    data_dir, target = tiny_data
    one_rank = tiny_config(world_size=1, batch_size=2, **RUN)  # the same global batch on one rank
    reference = losses(single_node.metrics_history)
    order = samples_by_step(single_node.metrics_history)

    # 2 -> 1: the two-rank checkpoint at step 4 resumes on one rank.
    halfway = single_node.last_checkpoint.parent / "step-000004"
    resumed = train_drafter(one_rank, data_dir, str(target), resume_from(halfway, tmp_path / "to-one"), progress=False)
    assert fmt.read_trainer_state(halfway).world_size == 2
    later = {step: reference[step] for step in range(5, 9)}
    assert losses(resumed.metrics_history) == pytest.approx(later, rel=1e-4)  # steps 6-8 need Adam's moments
    assert samples_by_step(resumed.metrics_history) == {step: order[step] for step in later}  # the data position
    final_two, final_one = (load_file(str(r.last_checkpoint / "drafter.safetensors")) for r in (single_node, resumed))
    for name, value in final_two.items():
        assert final_one[name] == pytest.approx(value, rel=1e-3, abs=1e-5), name

    # 1 -> 2: a one-rank run's step-4 checkpoint resumes on two ranks.
    fresh = train_drafter(one_rank, data_dir, str(target), tmp_path / "one", progress=False)
    assert losses(fresh.metrics_history) == pytest.approx(reference, rel=1e-4)  # the split does not change the run
    two_ranks_from_one = resume_from(tmp_path / "one" / "step-000004", tmp_path / "to-two")
    back = launch_training(tiny_config(world_size=2, **RUN), data_dir, str(target), two_ranks_from_one,
                           progress=False, env=ONE_THREAD)
    assert losses(back.metrics_history) == pytest.approx({s: losses(fresh.metrics_history)[s] for s in later}, rel=1e-4)
    assert samples_by_step(back.metrics_history) == {step: order[step] for step in later}
    assert fmt.read_trainer_state(back.last_checkpoint).world_size == 2
