"""Shared by the data-stage benchmarks: machine line, table printing and rendering.

A table is ``(title, headers, rows)`` with rows of already formatted strings; every
benchmark prints its tables and writes ``results/<name>.json`` (all numbers) and
``results/<name>.md`` (the same tables) in one go, through ``result_files``.
"""

from __future__ import annotations

import os
import platform
import time

import torch

from result_files import git_commit, load_average, load_results, markdown_table, write_results

Table = tuple[str, list[str], list[list[str]]]


def machine() -> str:
    return (f"{platform.machine()} x{len(os.sched_getaffinity(0))}, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), CPU only")


def started() -> dict:
    """Stamp taken before measuring (the cores are shared: the load average says how busy)."""
    return {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(), "commit": git_commit(),
            "load_avg_start": load_average()}


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
        lines += [f"## {title}", "", *markdown_table(headers, rows), ""]
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def report(name: str, result: dict, tables: list[Table], notes: list[str]) -> None:
    """Print the tables and write results/<name>.json and .md."""
    result.setdefault("load_avg_end", load_average())
    print_tables(tables)
    for n in notes:
        print(f"- {n}")
    json_path, md_path = write_results(name, result, markdown(name, result, tables, notes))
    print(f"wrote {json_path} and {md_path}")


def render_saved(name: str, tables, notes) -> None:
    """``--render-only``: re-print and re-write a saved run's tables from its numbers."""
    result = load_results(name)
    report(name, result, tables(result), notes(result))
