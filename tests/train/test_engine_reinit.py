"""A process whose torch.distributed group another library tore down can still train."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_process_group_is_rejoined_after_another_library_destroyed_it():
    """vLLM's engine shutdown destroys torch's default group behind DeepSpeed's back; DeepSpeed's
    cached clone of the old world group must not survive into the next training run."""
    from peagle.train.launch import DIST_ENV

    script = textwrap.dedent("""
        import torch.distributed as dist
        from deepspeed.utils import groups
        from peagle.train.engine import init_process_group

        init_process_group()
        groups._clone_world_group()      # what deepspeed.initialize caches on its first run
        dist.destroy_process_group()     # what vLLM's shutdown does, bypassing DeepSpeed
        init_process_group()
        print("rank", dist.get_global_rank(groups._clone_world_group(), 0))
    """)
    # a fresh process, as a user's: not the launcher variables an in-process test left in os.environ
    # (its MASTER_PORT is still held by this process's group: EADDRINUSE)
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "rank 0" in done.stdout
