"""The one place benchmark results are written: ``bench/results/<name>.{json,md}`` (+ plots).

Every bench script writes its numbers as JSON (``--render-only`` re-renders the tables
from it without measuring again) and the same tables as Markdown (what README tables
quote), atomically through ``peagle.fileio``. ``PEAGLE_BENCH_RESULTS`` moves the folder
(the smoke tests write into a temporary one). Every result records when it ran, on what
machine and at which commit; ``bench/readme.py`` quotes them in bench/README.md.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

from peagle.fileio import write_json_atomic, write_text_atomic

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = Path(os.environ.get("PEAGLE_BENCH_RESULTS", BENCH_DIR / "results"))


def load_average() -> list[float]:
    """1/5/15-minute load: the cores are shared, so every result records how busy they were."""
    return [round(x, 2) for x in os.getloadavg()]


def cpu_line() -> str:
    """The machine, for benchmarks that record no torch build: architecture and core count."""
    return f"{platform.machine()}, {os.cpu_count()} cores (shared)"


def git_commit() -> str | None:
    """The checkout's commit, marked when tracked files outside bench/results differ from it
    (the numbers then come from code no commit holds); None outside a git checkout.
    ``PEAGLE_BENCH_COMMIT`` names it instead, for a copy of the tree (a lent GPU box's) whose git
    is absent or stale."""
    if os.environ.get("PEAGLE_BENCH_COMMIT"):
        return os.environ["PEAGLE_BENCH_COMMIT"]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=BENCH_DIR, capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short=12", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results")
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{head} with uncommitted changes" if changed else head


def per_target_name(name: str, config: str | Path) -> str:
    """``name`` for the demo's config, ``<name>_<config stem>`` for another: one result file per target."""
    stem = Path(config).stem
    return name if stem == "demo" else f"{name}_{stem}"


def result_path(name: str, suffix: str, out_dir: Path | None = None) -> Path:
    """``<results>/<name><suffix>``, e.g. ``result_path("online_eval", ".png")``."""
    return Path(out_dir or RESULTS_DIR) / f"{name}{suffix}"


def markdown_table(columns: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table (right-aligned columns) from already formatted cells."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---:|" * len(columns)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def write_results(name: str, payload: dict, markdown: str, out_dir: Path | None = None) -> tuple[Path, Path]:
    """Write ``<name>.json`` (``payload``) and ``<name>.md`` (``markdown``); return both paths."""
    json_path, md_path = result_path(name, ".json", out_dir), result_path(name, ".md", out_dir)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(json_path, payload, indent=2, default=str)
    write_text_atomic(md_path, markdown)
    return json_path, md_path


def load_results(name: str, out_dir: Path | None = None) -> dict:
    """A previous run's saved numbers."""
    path = result_path(name, ".json", out_dir)
    if not path.exists():
        raise SystemExit(f"{path}: no saved results to render; run the benchmark without --render-only first")
    return json.loads(path.read_text())
