"""Shared pieces of the training benchmarks: head specs, synthetic samples, result files.

The machine is shared, so every result records the torch thread count and the load
average at the start and the end of the run; compare only ratios taken in one run.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from peagle.facts import HeadSpec

RESULTS_DIR = Path(os.environ.get("PEAGLE_BENCH_RESULTS", Path(__file__).resolve().parent / "results"))
MASK_TOKEN_ID = 3


def bench_spec(hidden: int = 192, layers: int = 2, vocab: int = 4096, draft_vocab: int = 2048) -> HeadSpec:
    """A drafter spec shaped like the embedded target's head (H = Ht = 192) or a larger one.

    Heads are 64 wide with a 3:1 query:KV ratio at H=192 (the demo head's) and 4:1 above.
    """
    heads = hidden // 64
    kv_heads = 1 if hidden <= 192 else max(1, heads // 4)
    return HeadSpec(
        target="synthetic",
        target_revision=None,
        target_num_layers=8,
        target_hidden_size=hidden,
        vocab_size=vocab,
        aux_layer_ids=[2, 4, 5],
        final_layer_id=8,
        mask_token_id=MASK_TOKEN_ID,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=64,
        intermediate_size=int(hidden * 8 / 3) // 64 * 64 or 64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=1 << 16,
        draft_vocab_size=draft_vocab,
    )


@dataclass
class SyntheticSample:
    """What the trainer reads from a shard: tokens, loss mask, [n, 4, Ht] hidden states."""

    token_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden: torch.Tensor


def synthetic_sample(length: int, spec: HeadSpec, seed: int, prompt_fraction: float = 0.1) -> SyntheticSample:
    """A chat-shaped document: a prompt (unsupervised) then a response (supervised)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, spec.vocab_size, (length,), generator=g)
    loss_mask = torch.zeros(length, dtype=torch.bool)
    loss_mask[int(length * prompt_fraction) :] = True
    hidden = torch.randn(length, 4, spec.target_hidden_size, generator=g)
    return SyntheticSample(tokens, loss_mask, hidden)


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine_info() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


class Run:
    """One benchmark run: machine info and load average at start, rows, files at the end."""

    def __init__(self, name: str, args: dict):
        self.name, self.args = name, args
        self.meta = {"benchmark": name, "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.meta.update(machine_info())
        self.meta["load_average_start"] = load_average()
        self.meta["args"] = args
        self.sections: list[dict] = []

    def add_table(self, title: str, columns: list[str], rows: list[list], note: str = "") -> None:
        self.sections.append({"title": title, "columns": columns, "rows": rows, "note": note})

    def finish(self, notes: list[str] | None = None) -> None:
        """Print every table and write results/<name>.json and .md atomically."""
        self.meta["load_average_end"] = load_average()
        self.meta["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.meta["notes"] = notes or []
        console = Console(width=200)
        for s in self.sections:
            table = Table(title=s["title"])
            for c in s["columns"]:
                table.add_column(c, justify="right")
            for r in s["rows"]:
                table.add_row(*[escape(_fmt(v)) for v in r])
            console.print(table)
            if s["note"]:
                console.print(escape(s["note"]))
        console.print(escape(self._meta_line()))
        for n in self.meta["notes"]:
            console.print(escape(f"- {n}"))
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        _write_atomic(RESULTS_DIR / f"{self.name}.json", json.dumps({"meta": self.meta, "tables": self.sections}, indent=2))
        _write_atomic(RESULTS_DIR / f"{self.name}.md", self._markdown())

    def _meta_line(self) -> str:
        m = self.meta
        return (
            f"{m['processor']} x{m['cpu_count']}, torch {m['torch']} ({m['torch_threads']} threads), "
            f"load avg start {m['load_average_start']} end {m['load_average_end']}, {m['started_utc']}"
        )

    def _markdown(self) -> str:
        lines = [f"# {self.name}", "", self._meta_line(), "", f"args: `{json.dumps(self.args)}`", ""]
        for s in self.sections:
            lines += [f"## {s['title']}", "", "| " + " | ".join(s["columns"]) + " |"]
            lines.append("|" + "---:|" * len(s["columns"]))
            lines += ["| " + " | ".join(_fmt(v) for v in r) + " |" for r in s["rows"]]
            lines += ["", s["note"], ""] if s["note"] else [""]
        lines += [f"- {n}" for n in self.meta["notes"]]
        return "\n".join(lines) + "\n"


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
