"""Training for a time budget (``train.recipe.max_train_seconds``): the clock, its LR schedule, a real run, resume."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the tiny-run builders live in test_deepspeed.py
from test_deepspeed import child_env, read_metrics, tiny_config, tiny_run  # noqa: F401 (fixtures)
from test_trainer import CHILD_TRAIN_THEN_DIE

from peagle import checkpoint_format as fmt
from peagle.train.budget import FIRST_IN_PROCESS, TrainingClock, counted_seconds, time_warmup_decay


def test_the_schedule_has_the_step_schedules_shape_on_time():
    clock = TrainingClock(budget_s=10.0)
    factor = time_warmup_decay(clock, warmup_ratio=0.2)
    assert factor(0) == 0.0  # nothing timed yet: no estimate of where a step ends
    seen = []
    for step in range(1, 11):  # LambdaLR asks for step s's rate once s-1 steps are done
        clock.add(1.0, device="cpu", world_size=1)
        seen.append(round(factor(step), 4))
    # step s (0-based) ends at s+1 seconds: warmup over the first 2 s, then linear decay to 0 at 10 s
    assert seen == [1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125, 0.0, 0.0]
    assert round(time_warmup_decay(TrainingClock(10.0, elapsed_s=1.0, steps=1), 0.2)(0), 4) == 0.5
    # with a step cap the run would reach first (4 steps of 1 s in 10 s), the schedule follows the steps
    capped, clock = [], TrainingClock(budget_s=10.0)
    for step in range(1, 5):
        clock.add(1.0, device="cpu", world_size=1)
        capped.append(round(time_warmup_decay(clock, warmup_ratio=0.2, max_steps=4)(step), 4))
    assert capped == [0.625, 0.3125, 0.0, 0.0]  # step s ends at (s+1)/4 of the steps, ahead of the clock


def test_the_clock_stops_at_the_step_ending_nearest_the_budget():
    clock = TrainingClock(budget_s=10.0)
    ends = []
    while not clock.done():
        clock.add(3.0, device="cpu", world_size=1)
        ends.append(clock.elapsed_s)
    assert ends == [3.0, 6.0, 9.0]  # a fourth step would end 2 s past the budget, the third ended 1 s before
    assert TrainingClock(10.0, elapsed_s=10.5, steps=3).done() and not TrainingClock(10.0).done()


def test_a_skipped_step_counts_as_done_but_not_in_the_mean():
    """A process's first step (compilation) is done but not timed: the schedule still knows it was
    taken, and the mean step - hence where later steps end and when the budget is spent - leaves it out."""
    clock = TrainingClock(budget_s=10.0)
    clock.skip()
    assert clock.mean_step_s is None and time_warmup_decay(clock, 0.2)(1) == 0.0 and not clock.done()
    clock.add(1.0, device="cpu", world_size=1)
    assert clock.mean_step_s == 1.0 and clock.elapsed_s == 1.0
    assert clock.fraction_at_end_of(2) == pytest.approx(0.2)  # steps 0 (skipped) and 1 (1 s) done: step 2 ends at 2 s
    resumed = TrainingClock(10.0, elapsed_s=4.0, steps=5, counted=4)  # as a checkpoint restores it
    assert resumed.mean_step_s == 1.0 and resumed.fraction_at_end_of(5) == pytest.approx(0.5)
    assert TrainingClock(10.0, elapsed_s=4.0, steps=4).counted == 4  # a state written before the rule: all counted
    records = [{"step_time_s": 9.0, FIRST_IN_PROCESS: True}, {"step_time_s": 1.0}, {"step_time_s": 2.0}, {"eval": 1}]
    assert counted_seconds(records) == 3.0


def test_the_time_bar_follows_the_clock_past_the_budget():
    """A skipped first step adds nothing to the bar, and a last step ending seconds past the budget
    still renders (tqdm drops a total it has passed: the bar's format then failed and killed a run)."""
    import io

    from peagle.train.trainer import advance, progress_bar

    clock = TrainingClock(budget_s=10.0)
    bar = progress_bar(0, 0, clock, "train peagle", show=True)
    bar.fp = io.StringIO()
    clock.skip()
    advance(bar, clock)
    assert bar.n == 0.0
    for seconds in (4.0, 4.0, 4.5):
        clock.add(seconds, device="cpu", world_size=1)
        advance(bar, clock)
    assert "12/12 s" in str(bar)
    bar.close()


def timed_records(out: Path) -> list[dict]:
    return [r for r in read_metrics(out) if "loss" in r]


@pytest.mark.slow
def test_training_runs_for_its_time_across_epochs_and_resumes_on_the_clock(tiny_run, tmp_path):
    """A real DeepSpeed run: it stops when its steps have taken the budget (more than one epoch of
    the tiny dataset), the learning rate warms up and decays to ~0 over the time, and a run killed
    midway resumes with the time already spent counted."""
    from peagle.train.trainer import train_drafter

    data_dir, target = tiny_run
    budget = 6.0
    cfg = tiny_config(max_train_seconds=budget, batch_size=2, save_every=3, keep_last=20, warmup_ratio=0.2)
    result = train_drafter(cfg, data_dir, str(target), tmp_path / "whole", progress=False)
    records = timed_records(tmp_path / "whole")
    steps = [r["step_time_s"] for r in records]
    counted = counted_seconds(records)
    print(f"{len(steps)} steps, {sum(steps):.2f} s ({counted:.2f} s counted), first {steps[0]:.3f} s")
    assert [bool(r.get(FIRST_IN_PROCESS)) for r in records] == [True] + [False] * (len(records) - 1)
    assert counted == pytest.approx(sum(steps[1:]))
    assert abs(counted - budget) <= max(steps[1:])  # stopped at the step ending nearest the budget
    assert records[-1]["train_seconds"] == pytest.approx(counted)
    assert max(r["epoch"] for r in records) >= 1  # 8 steps per epoch: the budget, not the epochs, ends it
    lrs = [r["lr"] for r in records]
    peak = max(lrs)
    assert peak == pytest.approx(cfg.train.recipe.learning_rate, rel=0.2)
    assert lrs[0] == 0.0 and lrs.index(peak) > 1  # warmup on time
    assert lrs[-1] < 0.25 * peak  # decayed with the budget (a step-count schedule would not know when)
    assert result.last_checkpoint.name == f"step-{len(steps):06d}"
    assert fmt.read_trainer_state(result.last_checkpoint).train_seconds == pytest.approx(counted)
    again = train_drafter(cfg, data_dir, str(target), tmp_path / "whole", progress=False)
    assert len(timed_records(tmp_path / "whole")) == len(steps) and again.last_checkpoint == result.last_checkpoint

    out = tmp_path / "killed"
    cfg_file, script = tmp_path / "cfg.json", tmp_path / "child.py"
    cfg_file.write_text(cfg.model_dump_json(by_alias=True))
    script.write_text(CHILD_TRAIN_THEN_DIE)
    child = subprocess.run([sys.executable, str(script), str(cfg_file), str(data_dir), str(target), str(out), "7"],
                           env=child_env(), capture_output=True, text=True, timeout=300)
    assert child.returncode == -9, child.stderr[-3000:]
    saved = fmt.read_trainer_state(out / "step-000006")
    assert saved.train_seconds == pytest.approx(counted_seconds(timed_records(out)[:6]))
    assert saved.counted_steps == 5
    train_drafter(cfg, data_dir, str(target), out, progress=False)
    resumed = timed_records(out)
    assert [r["step"] for r in resumed] == list(range(1, len(resumed) + 1))
    # the resumed process's first step compiles again: not counted; the one after it is
    assert resumed[6][FIRST_IN_PROCESS] and resumed[6]["train_seconds"] == pytest.approx(saved.train_seconds)
    assert resumed[7]["train_seconds"] == pytest.approx(saved.train_seconds + resumed[7]["step_time_s"])
    assert abs(resumed[-1]["train_seconds"] - budget) <= max(r["step_time_s"] for r in resumed[7:])


def test_the_eagle3_baseline_trains_for_the_time_the_head_took(tiny_run, tmp_path):
    """``train.baseline.budget: same_time``: the baseline's budget is the seconds the head's
    steps took on these inputs; its checkpoint directory, the trainer's recorded identity and the
    head's agree on it, and a baseline asked for before its head names the fix."""
    from peagle.identity import dataset_manifests, head_identity
    from peagle.stages import checkpoint_dir, method_config, with_train
    from peagle.train.trainer import train_drafter

    data_dir, target = tiny_run
    cfg = with_train(tiny_config(max_steps=30, baseline={"eagle3": True, "budget": "same_time"},
                                 eagle3={"ttt_steps": 2}), {"method": "peagle"}).model_copy(update={"workdir": str(tmp_path)})
    with pytest.raises(FileNotFoundError, match="train it first .*train.baseline.budget=same_steps"):
        method_config(cfg, "eagle3", data_dir)

    head_dir = checkpoint_dir(cfg, "peagle", data_dir)
    train_drafter(method_config(cfg, "peagle", data_dir), data_dir, str(target), head_dir, progress=False)
    head_seconds = counted_seconds(timed_records(head_dir))
    assert head_seconds < sum(r["step_time_s"] for r in timed_records(head_dir))  # its first step left out
    baseline_cfg = method_config(cfg, "eagle3", data_dir)
    assert baseline_cfg.train.method == "eagle3" and baseline_cfg.train.recipe.max_steps is None  # the time is the cap
    assert baseline_cfg.train.recipe.max_train_seconds == pytest.approx(head_seconds, abs=0.001)
    assert method_config(cfg, "peagle", data_dir).train.recipe.max_train_seconds is None  # the head keeps its steps
    same_steps = with_train(cfg, {"baseline.budget": "same_steps"})
    assert checkpoint_dir(same_steps, "eagle3", data_dir) != checkpoint_dir(cfg, "eagle3", data_dir)
    assert checkpoint_dir(same_steps, "peagle", data_dir) == head_dir

    out = checkpoint_dir(cfg, "eagle3", data_dir)
    result = train_drafter(baseline_cfg, data_dir, str(target), out, progress=False)
    trained = fmt.read_trainer_state(result.last_checkpoint)
    assert trained.head_identity == head_identity(baseline_cfg, dataset_manifests(data_dir), "eagle3")
    assert trained.head_identity.startswith(out.name)  # the directory named after the identity the trainer recorded
    assert trained.train_seconds == pytest.approx(head_seconds, abs=max(r["step_time_s"] for r in timed_records(out)))


@pytest.mark.slow  # torchrun with two DeepSpeed ranks: ~30 s on 2 cores
def test_two_ranks_keep_one_clock(tiny_run, tmp_path):
    """Each rank times its own steps; they must still take the same learning rates (ZeRO-0: every
    rank updates all the weights, so replicas diverge otherwise: checkpoints compare them) and stop
    at the same step (a rank left waiting in a collective would hang the run)."""
    from test_deepspeed import ONE_THREAD

    from peagle.train.launch import launch_training

    data_dir, target = tiny_run
    cfg = tiny_config(world_size=2, zero_stage=0, max_train_seconds=4.0, save_every=5, keep_last=50)
    result = launch_training(cfg, data_dir, str(target), tmp_path / "out", progress=False, env=ONE_THREAD)
    records = timed_records(tmp_path / "out")
    assert abs(records[-1]["train_seconds"] - 4.0) <= max(r["step_time_s"] for r in records) + 0.5
    states = [fmt.read_trainer_state(p) for p in fmt.list_checkpoints(tmp_path / "out")]
    assert len(states) >= 2 and all(len(set(s.replica_checksums)) == 1 for s in states)
    assert result.last_checkpoint.name == f"step-{len(records):06d}"
