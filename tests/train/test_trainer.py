"""The training loop: data order, kill -9 and resume, segments, the EAGLE-3 objective, early errors."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the tiny-run builders live in test_deepspeed.py
from test_deepspeed import child_env, one_thread, step_losses, tiny_config, tiny_run  # noqa: F401 (fixtures)

from peagle import checkpoint_format as fmt
from peagle.train.data import BatchPlan, MicroBatches, epoch_permutation, example_generator, rank_order


def test_epoch_order_is_seeded_sharded_and_resumable():
    plan = BatchPlan(num_samples=11, world_size=2, micro_batch_size=2, grad_accum=1)
    assert plan.steps_per_epoch == 2  # 5 samples per rank, 2 per step: the odd ones are dropped
    r0, r1 = rank_order(plan, epoch=0, seed=7, rank=0), rank_order(plan, epoch=0, seed=7, rank=1)
    assert len(r0) == len(r1) == 4 and not set(r0) & set(r1)
    assert r0 == rank_order(plan, epoch=0, seed=7, rank=0)  # same run or another: same order
    assert epoch_permutation(11, 1, 7) != epoch_permutation(11, 0, 7)  # reshuffled every epoch
    assert list(MicroBatches(r0, 2, skip=1)) == [r0[2:4]]  # resume mid-epoch
    draws = [torch.randperm(100, generator=example_generator(7, 0, i)).tolist() for i in (3, 3, 4)]
    assert draws[0] == draws[1] != draws[2]
    with pytest.raises(ValueError, match="fewer than one optimizer step"):
        BatchPlan(num_samples=3, world_size=2, micro_batch_size=1, grad_accum=2).check()
    with pytest.raises(ValueError, match="rank 2 is outside world size 2"):
        rank_order(plan, epoch=0, seed=7, rank=2)
    with pytest.raises(ValueError, match="cannot skip 3 of 2 micro-batches"):
        MicroBatches(r0, 2, skip=3)  # a resume past the epoch's end


CHILD_TRAIN_THEN_DIE = r"""
import json, os, signal, sys, torch
from pathlib import Path
from peagle.config import parse_config
from peagle.train.trainer import train_drafter

torch.set_num_threads(1)
cfg_path, data_dir, target, out, kill_at = sys.argv[1:6]

def on_metrics(step, record):
    if step == int(kill_at):
        os.kill(os.getpid(), signal.SIGKILL)

cfg = parse_config(json.loads(Path(cfg_path).read_text()))
train_drafter(cfg, Path(data_dir), target, Path(out), progress=False, on_metrics=on_metrics)
"""


@pytest.mark.slow
def test_kill9_then_resume_reproduces_the_uninterrupted_run(tiny_run, tmp_path):
    from peagle.train.trainer import train_drafter

    data_dir, target = tiny_run
    # 16 samples, 2 micro-batches per step: 8 steps per epoch; 12 steps cross an epoch.
    cfg = tiny_config(max_steps=12, batch_size=2, save_every=3, keep_last=10)
    reference = train_drafter(cfg, data_dir, str(target), tmp_path / "reference", progress=False)
    expected = {r["step"]: r["loss"] for r in reference.metrics_history}

    out = tmp_path / "killed"
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(cfg.model_dump_json(by_alias=True))
    script = tmp_path / "child.py"
    script.write_text(CHILD_TRAIN_THEN_DIE)
    child = subprocess.run(
        [sys.executable, str(script), str(cfg_file), str(data_dir), str(target), str(out), "5"],
        env=child_env(), capture_output=True, text=True, timeout=300,
    )
    assert child.returncode == -9, child.stderr[-3000:]
    killed_at = time.time()
    assert max(step_losses(out)) == 5 and fmt.latest_checkpoint(out) == out / "step-000003"
    state = fmt.read_trainer_state(out / "step-000003")
    assert (state.epoch, state.epoch_position) == (0, 6)  # mid-epoch

    result = train_drafter(cfg, data_dir, str(target), out, progress=False)  # resumes from `latest`
    resumed = step_losses(out)
    assert sorted(resumed) == list(range(1, 13))
    for step in range(1, 13):
        assert resumed[step] == pytest.approx(expected[step], abs=1e-6, rel=1e-6), f"step {step}"
    assert (out / "step-000003" / "trainer_state.json").stat().st_mtime < killed_at  # not retrained
    assert [p.name for p in fmt.list_checkpoints(out)] == [f"step-{s:06d}" for s in (3, 6, 9, 12)]
    assert result.last_checkpoint == out / "step-000012"


def test_segments_accumulate_inside_the_sequence(tiny_run, tmp_path):
    """S segments per micro-batch give the single-pass gradients: the same loss trajectory."""
    from peagle.train.trainer import train_drafter

    data_dir, target = tiny_run
    runs = {}
    for segments in (1, 3):
        cfg = tiny_config(max_steps=4, batch_size=2, segments=segments)
        result = train_drafter(cfg, data_dir, str(target), tmp_path / f"s{segments}", progress=False)
        runs[segments] = result.metrics_history
    assert [r["loss"] for r in runs[3]] == pytest.approx([r["loss"] for r in runs[1]], rel=1e-5, abs=1e-6)
    assert [r["acc"] for r in runs[3]] == pytest.approx([r["acc"] for r in runs[1]], abs=1e-9)


def collated_sizes(monkeypatch) -> list[int]:
    """Record the element count of every batch the trainer collates (a spy on the ``collate`` that
    P-EAGLE's objective calls)."""
    from peagle.methods import peagle as peagle_method

    sizes, real = [], peagle_method.collate

    def spy(examples, mask):
        sizes.append(max(len(e) for e in examples))
        return real(examples, mask)

    monkeypatch.setattr(peagle_method, "collate", spy)
    return sizes


def long_inputs(data_dir, n: int, cfg):
    """The spec ``cfg`` trains on the tiny dataset, its vocabulary and one n-token sample (random hidden states)."""
    from peagle.train.trainer import TrainingInputs, load_training_inputs
    from tests.objective.test_partition import random_sample

    inputs = load_training_inputs(data_dir, cfg)
    return TrainingInputs(spec=inputs.spec, samples=[random_sample(inputs.spec, n, 0)], draft_ids=inputs.draft_ids)


def test_segments_never_collate_the_whole_micro_batch(tiny_run, tmp_path, monkeypatch):
    """With S > 1 only segments are collated: the whole example's [N, N] mask is never built."""
    from peagle.objective.batch import build_peagle_example
    from peagle.objective.partition import partition_example
    from peagle.train.trainer import train_drafter

    data_dir, target = tiny_run
    n, segments = 400, 4
    cfg = tiny_config(max_steps=1, max_len=n, segments=segments)
    inputs = long_inputs(data_dir, n, cfg)
    t = cfg.train
    example = build_peagle_example(inputs.samples[0], inputs.spec, t.peagle.k_train, t.peagle.cod_ratio, t.peagle.cod_floor, n,
                                   example_generator(t.recipe.seed, 0, 0))  # what the trainer builds for sample 0
    sizes = collated_sizes(monkeypatch)
    result = train_drafter(cfg, data_dir, str(target), tmp_path / "out", progress=False, inputs=inputs)
    assert sizes == [len(seg.example) for seg in partition_example(example, segments)]
    assert max(sizes) < len(example)  # each segment: its anchors' context plus its own deeper elements
    assert torch.isfinite(torch.tensor(result.metrics_history[-1]["loss"]))


@pytest.mark.slow
def test_16k_token_sequence_trains_through_train_drafter(tiny_run, tmp_path, monkeypatch):
    """A 16K-token sequence trains on this machine, through the real trainer."""
    import resource

    from peagle.train.trainer import train_drafter

    data_dir, target = tiny_run
    n, segments = 16384, 8
    sizes = collated_sizes(monkeypatch)
    cfg = tiny_config(max_steps=1, max_len=n, segments=segments, k_train=4)
    result = train_drafter(cfg, data_dir, str(target), tmp_path / "out", progress=False, inputs=long_inputs(data_dir, n, cfg))
    record = result.metrics_history[0]
    assert torch.isfinite(torch.tensor(record["loss"])) and record["tokens"] == n
    assert len(sizes) == segments and result.last_checkpoint is not None
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"16K tokens, S={segments}: largest segment {max(sizes)} elements, {record['step_time_s']:.1f} s, "
          f"process peak RSS {peak_gib:.2f} GiB")


def test_method_eagle3_swaps_the_objective(tiny_run, tmp_path):
    from peagle.train.trainer import train_drafter

    data_dir, target = tiny_run
    cfg = tiny_config(method="eagle3", eagle3={"ttt_steps": 2}, max_steps=3)
    result = train_drafter(cfg, data_dir, str(target), tmp_path / "out", progress=False)
    last = result.metrics_history[-1]
    assert "acc/depth_1" in last and "acc/depth_2" not in last  # 2 TTT steps, not k_train=3 depths
    assert all(torch.isfinite(torch.tensor([r["loss"] for r in result.metrics_history])))


def test_bad_inputs_fail_before_training(tiny_run, tmp_path):
    from peagle.train.trainer import train_drafter

    data_dir, target = tiny_run
    with pytest.raises(ValueError, match="train.launch.world_size=2 but this process group has 1"):
        train_drafter(tiny_config(world_size=2), data_dir, str(target), tmp_path / "a", progress=False)
    with pytest.raises(FileNotFoundError, match="build the dataset first"):
        train_drafter(tiny_config(), tmp_path / "nothing", str(target), tmp_path / "b", progress=False)
    with pytest.raises(ValueError, match="fewer than one optimizer step"):
        train_drafter(tiny_config(micro_batch_size=8, batch_size=32), data_dir, str(target), tmp_path / "c", progress=False)
    out = tmp_path / "d"
    train_drafter(tiny_config(max_steps=1), data_dir, str(target), out, progress=False)
    with pytest.raises(ValueError, match="cannot resume"):
        train_drafter(tiny_config(max_steps=2, learning_rate=1e-2), data_dir, str(target), out, progress=False)
    with pytest.raises(ValueError, match=r"cannot resume .*another head \(num_layers: checkpoint 1, now 2\)"):
        train_drafter(tiny_config(max_steps=1, drafter_layers=2), data_dir, str(target), out, progress=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="flex attention trains on CUDA")
def test_flex_attention_on_a_cpu_is_refused_before_training(tiny_run, tmp_path):
    """torch has no flex-attention backward on CPU: ``train.launch.attention: flex`` there is named with
    its fix before DeepSpeed starts; ``auto`` (the default) trains there with the dense mask."""
    from peagle.train.trainer import train_drafter

    data_dir, target = tiny_run
    with pytest.raises(ValueError, match=r"train.launch.attention: flex cannot train on cpu.*set train.launch.attention: auto"):
        train_drafter(tiny_config(attention="flex"), data_dir, str(target), tmp_path / "flex", progress=False)
    assert not (tmp_path / "flex").exists()


def test_launcher_streams_output_and_reports_a_failing_child(caplog, tmp_path):
    from peagle.train.launch import TrainingFailed, run_streaming, training_command

    caplog.set_level("DEBUG", logger="peagle.train.ranks")
    run_streaming([sys.executable, "-c", "print('step 1'); print('step 2')"], output=tmp_path / "train.log")
    assert (tmp_path / "train.log").read_text() == "step 1\nstep 2\n"  # the ranks' output, in the run dir
    assert [r.message for r in caplog.records if r.name == "peagle.train.ranks"] == ["step 1", "step 2"]
    failing = [sys.executable, "-c", "print('loading'); raise SystemExit('rank 0: target not found')"]
    with pytest.raises(TrainingFailed, match="exited with code 1") as err:
        run_streaming(failing)
    assert "rank 0: target not found" in str(err.value)  # the child's own error is in the message

    cmd = training_command(Path("c.json"), Path("data"), "target", Path("out"), tiny_config(world_size=4).train)
    assert cmd[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "-m"]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\nnode-a slots=8\nnode-b slots=8\n")
    cmd = training_command(Path("c.json"), Path("data"), "target", Path("out"),
                           tiny_config(world_size=16, hostfile=str(hostfile)).train)
    assert cmd[:7] == ["deepspeed", "--hostfile", str(hostfile), "--master_addr", "node-a", "--module", "peagle.train.launch"]
    # The pipeline's ranks run peagle.rank (training handed offline evaluation), under either launcher.
    cmd = training_command(Path("c.json"), Path("data"), "target", Path("out"),
                           tiny_config(world_size=16, hostfile=str(hostfile)).train, rank_module="peagle.rank")
    assert cmd[5:7] == ["--module", "peagle.rank"]
    single = training_command(Path("c.json"), Path("data"), "target", Path("out"), tiny_config(world_size=2).train,
                              rank_module="peagle.rank")
    assert single[single.index("--nproc_per_node=2") + 1:][:2] == ["-m", "peagle.rank"]
    told = training_command(Path("c.json"), Path("data"), "target", Path("out"), tiny_config(world_size=2).train,
                            head_identity="0576db343df1")
    assert told[-2:] == ["--head-identity", "0576db343df1"]  # the ranks check a resume against it
