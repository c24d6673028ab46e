"""Training progress reaches peagle's logs while the ranks run, not after."""

import json
import logging
import sys
import textwrap
from pathlib import Path

import pytest

from peagle.train.launch import TrainingProgress, format_duration, run_streaming

# A stand-in for rank 0: appends one metrics record per step (as MetricsLog does), slowly,
# and prints when it wrote its last one.
FAKE_RANK = textwrap.dedent("""
    import json, sys, time
    path, steps = sys.argv[1], int(sys.argv[2])
    for step in range(1, steps + 1):
        time.sleep(0.4)
        with open(path, "a") as fh:
            fh.write(json.dumps({"step": step, "loss": 3.0 / step, "acc": 0.1 * step,
                                 "tokens_per_s": 1000.0 + step, "step_time_s": 0.4}) + "\\n")
    with open(path, "a") as fh:
        fh.write(json.dumps({"step": steps, "eval/acceptance": 2.5}) + "\\n")
    print("finished at", time.time(), flush=True)
""")


def test_progress_lines_are_logged_while_the_ranks_run(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="peagle.train.launch")
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, "loss": 9.0}) + "\n")  # history before the checkpoint resumed from
    progress = TrainingProgress(metrics, total_steps=6, label="train peagle", resumed_at=1, every_s=0.0)
    run_streaming([sys.executable, "-c", FAKE_RANK, str(metrics), "6"], output=tmp_path / "train.log",
                  on_poll=progress.poll, poll_s=0.1)
    progress.poll(final=True)

    lines = [r for r in caplog.records if r.name == "peagle.train.launch"]
    steps = [r for r in lines if "loss" in r.getMessage()]
    assert [r.getMessage().split(",")[0] for r in steps] == [f"train peagle: step {s}/6" for s in range(2, 7)]
    assert "loss 1.5000" in steps[0].getMessage() and "1,002 tokens/s" in steps[0].getMessage()
    assert all("ETA" in r.getMessage() for r in steps[:-1]) and "ETA" not in steps[-1].getMessage()
    assert any("offline acceptance 2.500" in r.getMessage() for r in lines)
    finished = float((tmp_path / "train.log").read_text().split()[-1])
    assert steps[0].created < finished - 1.0  # logged while the rank was still training


def test_progress_is_throttled_but_keeps_first_and_last_step(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="peagle.train.launch")
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 1.0, "tokens_per_s": 10.0}) + "\n" for s in range(1, 51)))
    progress = TrainingProgress(metrics, total_steps=50, label="train eagle3", every_s=3600)
    progress.poll()
    messages = [r.getMessage() for r in caplog.records]
    assert [m.split(",")[0] for m in messages] == ["train eagle3: step 1/50", "train eagle3: step 50/50"]
    with metrics.open("a") as fh:
        fh.write('{"step": 51, "loss"')  # a line being written is not read half
    progress.poll()
    assert len(caplog.records) == 2


def test_durations_read_like_an_eta():
    assert [format_duration(s) for s in (7, 75, 3725)] == ["7s", "1m15s", "1h02m"]


def test_a_rank_flushes_subnormal_floats_on_its_threads():
    """Subnormal arithmetic takes a slow path on CPUs; a rank (its own process) flushes it to
    zero on its main thread and on the threads it starts later (torch's workers)."""
    import subprocess

    code = textwrap.dedent("""
        import threading, torch
        from peagle.train.engine import flush_denormals
        tiny = lambda: (torch.tensor([1e-39]) * 1.0).item()
        before = tiny()
        flushed = flush_denormals()
        seen = []
        worker = threading.Thread(target=lambda: seen.append(tiny()))
        worker.start(); worker.join()
        print(before > 0, flushed, tiny(), seen[0])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True", "0.0", "0.0"], out


def last_line_of(code: str) -> list[str]:
    """The words of the last line ``python -c CODE`` prints (DeepSpeed and argparse print above it)."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return done.stdout.splitlines()[-1].split()


@pytest.mark.slow
def test_a_rank_starts_without_mlflow_and_scikit_learn_and_the_launcher_keeps_them():
    """A rank's process (``python -m peagle.rank``, run here as torchrun runs it, to its argument
    parsing) marks MLflow and scikit-learn absent before its imports: DeepSpeed then starts
    without MLflow and transformers loads model classes without scikit-learn. A process that
    imports peagle.rank as a library (the launcher's, which tracks the run) keeps both."""
    rank = textwrap.dedent("""
        import runpy, sys
        sys.argv = ["peagle.rank", "--help"]
        try:
            runpy.run_module("peagle.rank", run_name="__main__", alter_sys=True)
        except SystemExit as done:
            assert done.code == 0, done.code
        from deepspeed.autotuning import autotuner
        from transformers import LlamaForCausalLM
        print(sys.modules["mlflow"] is None, sys.modules["sklearn"] is None, autotuner.has_mlflow)
    """)
    assert last_line_of(rank) == ["True", "True", "False"]
    assert last_line_of("import peagle.rank, mlflow, sklearn; print(mlflow.__name__, sklearn.__name__)") == [
        "mlflow", "sklearn"]


def test_muon_on_a_cpu_without_a_compiler_is_refused_before_any_rank_starts(tmp_path, monkeypatch):
    """torch.compile (Muon's update) needs a C++ compiler on a CPU: say so, and how to fix it."""
    import torch

    from peagle.config import ConfigError
    from peagle.train.launch import check_optimizer_runs_here, launch_training

    sys.path.insert(0, str(Path(__file__).parent))
    from test_deepspeed import tiny_config

    if torch.cuda.is_available():
        pytest.skip("the check is for CPU machines")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # nothing on it
    monkeypatch.delenv("CXX", raising=False)
    check_optimizer_runs_here(tiny_config().train)  # AdamW compiles nothing
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"needs a C\+\+ compiler.*apt-get install g\+\+.*optimizer: adamw"):
        launch_training(tiny_config(optimizer="muon"), tmp_path / "data", "target", out)
    assert not out.exists()  # nothing started, nothing written


# ----------------------------------------------------------------------------- checked before any rank starts


def _tiny_run(tmp_path):
    """A tiny target and a real dataset of its hidden states (tests/train/test_deepspeed.py's builders)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_deepspeed import build_tiny_dataset, build_tiny_target

    target = build_tiny_target(tmp_path / "target")
    return build_tiny_dataset(tmp_path / "data", target, num_samples=12), target


def test_a_corrupt_shard_is_refused_before_any_rank_starts(tmp_path, monkeypatch):
    """16 bytes flipped in one shard: no rank starts; the message names the shard and the fix."""
    from peagle.data.errors import CorruptShardError
    from peagle.train.launch import launch_training

    sys.path.insert(0, str(Path(__file__).parent))
    from test_deepspeed import tiny_config

    monkeypatch.setenv("PEAGLE_HOME", str(tmp_path / "home"))
    data_dir, target = _tiny_run(tmp_path)
    shard = data_dir / "splits" / "train" / "shard-00001.safetensors"
    blob = bytearray(shard.read_bytes())
    blob[len(blob) // 2 : len(blob) // 2 + 16] = bytes(b ^ 0xFF for b in blob[len(blob) // 2 : len(blob) // 2 + 16])
    shard.write_bytes(bytes(blob))
    out = tmp_path / "out"
    with pytest.raises(CorruptShardError, match=rf"{shard} \(its sha256 does not match.*`peagle data CONFIG --repair`"):
        launch_training(tiny_config(max_steps=2), data_dir, str(target), out, progress=False)
    assert not out.exists()  # nothing started, nothing written


def test_no_dataset_is_refused_before_any_rank_starts(tmp_path):
    from peagle.data.errors import MissingDatasetError
    from peagle.train.launch import launch_training

    sys.path.insert(0, str(Path(__file__).parent))
    from test_deepspeed import tiny_config

    out = tmp_path / "out"
    with pytest.raises(MissingDatasetError, match=r"no usable dataset in .*data.*`peagle data CONFIG`"):
        launch_training(tiny_config(max_steps=2), tmp_path / "data", "target", out, progress=False)
    assert not out.exists()


def test_too_little_disk_for_the_checkpoints_is_refused_before_any_rank_starts(tmp_path, small_disk):
    from peagle.data.errors import DiskSpaceError
    from peagle.train.launch import checkpoint_space_needed, launch_training

    sys.path.insert(0, str(Path(__file__).parent))
    from test_deepspeed import tiny_config

    data_dir, target = _tiny_run(tmp_path)
    cfg = tiny_config(max_steps=2, keep_last=3)
    needed, at_once, each = checkpoint_space_needed(cfg, data_dir, tmp_path / "none")
    assert at_once == 5 and needed == 5 * each
    disk = small_disk(needed - (1 << 20))
    out = disk.path / "checkpoints"
    with pytest.raises(DiskSpaceError, match=r"training \(5 checkpoints of up to .* train\.checkpoints\.keep_last=3, the "
                                             r"best and the one being written\) needs .*lower train\.checkpoints\.keep_last"):
        launch_training(cfg, data_dir, str(target), out, progress=False)
    assert not out.exists()
