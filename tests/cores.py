"""The cores a test run computes on: each pytest-xdist worker on cores of its own.

The suite's tests start multi-threaded processes (vLLM engines, training ranks, Prefect and
MLflow servers). Two workers side by side on a small machine would run every such process's
threads on every core, against each other's (OpenMP threads that wait spin), and far slower
than with each worker on cores of its own. So each worker is pinned to an equal
share of the run's cores (``pin_xdist_worker``), and every process it starts inherits that
share (vLLM binds its threads within it, torch sizes its pool to it). A test that needs more,
several engine replicas at once, is marked ``all_cores`` (``needs_cores``) and runs with every
core of the run.
"""

from __future__ import annotations

import os

import pytest

CORES_ENV = "PEAGLE_TEST_CORES"  # the run's cores, read before any worker is pinned; workers inherit it


def run_cores() -> list[int]:
    """Every core this test run may use (also inside a pinned worker)."""
    os.environ.setdefault(CORES_ENV, ",".join(map(str, sorted(os.sched_getaffinity(0)))))
    return [int(c) for c in os.environ[CORES_ENV].split(",")]


def pin_xdist_worker() -> None:
    """Pin this pytest-xdist worker (gwI of N) to the I-th of N equal shares of the run's cores;
    nothing outside xdist, or with more workers than cores."""
    cores = run_cores()
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker or not count or len(cores) < int(count):
        return
    share, index = len(cores) // int(count), int(worker.removeprefix("gw"))
    os.sched_setaffinity(0, cores[index * share:(index + 1) * share])


def needs_cores(n: int):
    """Mark a test that runs ``n`` engine replicas at once: it runs with every core of the run
    (``all_cores``), and is skipped where the run has fewer than ``n``."""
    def mark(test):
        skip = pytest.mark.skipif(len(run_cores()) < n, reason=f"needs {n} CPU cores for {n} engine replicas")
        return pytest.mark.all_cores(skip(test))
    return mark
