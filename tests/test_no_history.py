"""The product speaks of itself: what users read and run says what peagle is and does now.

Development history (a work session's number, an issue number, a row labelled "before" or
"after" a change) belongs to git's log, not to comments, docstrings, configs, docs, the
benchmarks or the prose their result files carry. Every text file under the checked paths
is read, results included: a benchmark that writes such words into its results is caught
too (bench/results/*.md and *.json are the scripts' own rendering; re-render them with the
script's ``--render-only`` once its wording is fixed).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# What history reads like, and how a reader would name it.
HISTORY = [
    (re.compile(r"\b(this|last|earlier|previous|next) session\b", re.I), "a development session"),
    (re.compile(r"\bsessions? [0-9]+", re.I), "a session number"),
    (re.compile(r"#[0-9]+\b"), "an issue number"),
    (re.compile(r"\bissues? #?[0-9]+\b", re.I), "an issue number"),
    (re.compile(r" \((before|after|old)[):]", re.I), "a before/after label"),
    (re.compile(r"\buntil this change\b", re.I), "a change's history"),
]

CHECKED = ["README.md", "CHANGELOG.md", "Makefile", "pyproject.toml", "prefect.yaml", ".ci",
           "docs", "peagle", "flows", "configs", "bench", "deploy", "docker", "tests"]
# Paths still telling the project's history (a strict xfail: it fails once the path passes).
AWAITING_REWRITE: set[str] = set()
SKIPPED_PARTS = {"__pycache__", ".pytest_cache"}


def text_files(path: Path) -> list[Path]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return [f for f in files if not SKIPPED_PARTS & set(f.parts) and f != Path(__file__).resolve()]


def history_in(path: Path) -> list[str]:
    """``file:line: text (what it is)`` for every line of ``path`` that reads as history."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:  # images and other binary files hold no prose
        return []
    found = []
    for number, line in enumerate(lines, 1):
        for pattern, what in HISTORY:
            match = pattern.search(line)
            if match:
                where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
                found.append(f"{where}:{number}: {match.group(0)!r} ({what})")
    return found


def test_every_checked_path_exists():
    missing = [p for p in CHECKED if not (REPO / p).exists()]
    assert not missing, f"{missing}: renamed or removed? update CHECKED in {Path(__file__).name}"


@pytest.mark.parametrize("checked", [
    pytest.param(p, marks=pytest.mark.xfail(strict=True, reason="awaits its rewrite: AWAITING_REWRITE"))
    if p in AWAITING_REWRITE else p for p in CHECKED])
def test_no_development_history(checked):
    found = [hit for f in text_files(REPO / checked) for hit in history_in(f)]
    assert not found, ("development history where the product should speak of itself; say what peagle "
                       "is and does now (git log keeps the history):\n" + "\n".join(found[:40]))


def test_the_patterns_catch_history_and_pass_the_product(tmp_path):
    history = tmp_path / "history.md"
    history.write_text("as session 21 found\nfixed in #13\nissue 13's bar\n| reader (before) | 1 |\n"
                       "what the trainer built until this change\nthe earlier session's run\n")
    assert len(history_in(history)) == 6
    product = tmp_path / "product.py"
    product.write_text("before = torch.get_num_threads()\ncolor = '#1f77b4'\n# a session token is a secret\n"
                       "# results of earlier invocations are kept\n")
    assert history_in(product) == []
