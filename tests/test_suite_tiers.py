"""The suite's tiers collect as the Makefile runs them: `make test` (what CI runs) the whole
suite, `make test-fast` the tests not marked slow, `make coverage` the whole suite without
pytest-timeout (coverage.py slows every test past its own limit)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def pytest_args_of(target: str) -> list[str]:
    """The arguments ``make TARGET`` gives pytest (``make -n`` prints its commands, running none), as
    typed in a shell: not the variables of a ``make`` this suite runs under (CI's PYTEST_ARGS)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    commands = subprocess.run(["make", "-n", target], cwd=REPO, env=env, capture_output=True, text=True,
                              check=True).stdout
    [line] = [c for c in commands.splitlines() if " -m pytest" in c]
    return shlex.split(line.split(" -m pytest", 1)[1])


def collected(args: list[str]) -> tuple[int, int]:
    """(tests selected, tests collected) by pytest with ``args``."""
    done = subprocess.run([sys.executable, "-m", "pytest", *args, "--collect-only", "-q"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    counts = re.search(r"(\d+)(?:/(\d+))? tests? collected", done.stdout)
    assert counts is not None, done.stdout[-3000:]
    return int(counts[1]), int(counts[2] or counts[1])


@pytest.mark.slow
def test_each_tier_collects_as_the_makefile_runs_it():
    """`make test` selects nothing: test-fast's count of all it collected is the whole suite's."""
    assert not {"-m", "-k"} & set(pytest_args_of("test"))
    fast, whole = collected(pytest_args_of("test-fast"))
    coverage_args = pytest_args_of("coverage")
    assert "no:timeout" in coverage_args
    assert collected(coverage_args) == (whole, whole)
    assert 0 < fast < whole
