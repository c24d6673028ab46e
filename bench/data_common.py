"""Shared by the data-stage benchmarks: machine line, table printing, atomic result files.

A table is ``(title, headers, rows)`` with rows of already formatted strings; every
benchmark prints its tables and writes ``results/<name>.json`` (all numbers) and
``results/<name>.md`` (the same tables) in one go.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"

Table = tuple[str, list[str], list[list[str]]]


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> str:
    return (f"{platform.machine()} x{len(os.sched_getaffinity(0))}, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), CPU only")


def started() -> dict:
    """Stamp taken before measuring (the cores are shared: the load average says how busy)."""
    return {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(), "load_avg_start": load_avg()}


def print_tables(tables: list[Table]) -> None:
    from rich.console import Console
    from rich.table import Table as RichTable

    console = Console()
    for title, headers, rows in tables:
        t = RichTable(title=title)
        for h in headers:
            t.add_column(h, justify="right")
        for row in rows:
            t.add_row(*row)
        console.print(t)


def markdown(name: str, result: dict, tables: list[Table], notes: list[str]) -> str:
    lines = [f"# {name}", "",
             f"{result['machine']}, load avg start {result.get('load_avg_start')} end {result.get('load_avg_end')}, "
             f"{result['when']}", ""]
    for title, headers, rows in tables:
        lines += [f"## {title}", "", "| " + " | ".join(headers) + " |", "|" + "---:|" * len(headers)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        lines.append("")
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def report(name: str, result: dict, tables: list[Table], notes: list[str]) -> None:
    """Print the tables and write results/<name>.json and .md."""
    result.setdefault("load_avg_end", load_avg())
    print_tables(tables)
    for n in notes:
        print(f"- {n}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    _write_atomic(RESULTS / f"{name}.json", json.dumps(result, indent=1))
    _write_atomic(RESULTS / f"{name}.md", markdown(name, result, tables, notes))
    print(f"wrote {RESULTS / name}.json and .md")


def load_result(name: str) -> dict:
    """A previous run's numbers (to re-render its tables without measuring again)."""
    return json.loads((RESULTS / f"{name}.json").read_text())


def render_saved(name: str, tables, notes) -> None:
    """``--render-only``: re-print and re-write a saved run's tables from its numbers."""
    result = load_result(name)
    report(name, result, tables(result), notes(result))
