"""The target a benchmark measures: its config's, the tiny ``embedded`` test target built first
when the config names it (a pipeline run never builds it; a benchmark on a fresh clone does)."""

from __future__ import annotations

from peagle.config import TargetConfig
from peagle.target import resolve_target
from peagle.testing.embedded import build_embedded_target


def bench_target(target: TargetConfig) -> str:
    """``target`` resolved to what engines and transformers load."""
    if target.is_embedded:
        build_embedded_target(target.embedded)
    return resolve_target(target)
