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

from result_files import git_commit, load_average, load_results, markdown_table, write_results

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


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), where platform.processor() says only the architecture."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


class Run:
    """One benchmark run: machine info and load average at start, rows, files at the end."""

    def __init__(self, name: str, args: dict):
        self.name, self.args = name, args
        self.meta = {"benchmark": name, "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     "commit": git_commit()}
        self.meta.update(machine_info())
        self.meta["load_average_start"] = load_average()
        self.meta["args"] = args
        self.sections: list[dict] = []

    @classmethod
    def restore(cls, name: str) -> Run:
        """A saved run (results/<name>.json) without its tables, to re-render them from its numbers."""
        saved = load_results(name)
        run = cls.__new__(cls)
        run.name, run.meta, run.sections = name, saved["meta"], []
        run.args = run.meta["args"]
        return run

    def add_table(self, title: str, columns: list[str], rows: list[list], note: str = "") -> None:
        self.sections.append({"title": title, "columns": columns, "rows": rows, "note": note})

    def finish(self, notes: list[str] | None = None, partial: bool = False) -> None:
        """Print every table and write results/<name>.json and .md atomically. ``partial``: a
        long run's rows so far, written quietly after each row, so an interrupted run keeps them."""
        self.meta["notes"] = notes or []
        if partial:
            self.meta["partial"] = True
            write_results(self.name, {"meta": self.meta, "tables": self.sections}, self._markdown())
            return
        self.meta.pop("partial", None)
        self.meta.setdefault("load_average_end", load_average())  # set already in a restored run
        self.meta.setdefault("finished_utc", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
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
        write_results(self.name, {"meta": self.meta, "tables": self.sections}, self._markdown())

    def _meta_line(self) -> str:
        m = self.meta
        end = "(running: the rows so far)" if m.get("partial") else m["load_average_end"]
        gpu = f"{m['gpu']}, " if m.get("gpu") else ""
        return (
            f"{gpu}{m.get('cpu_model') or m['processor']} x{m['cpu_count']}, torch {m['torch']} ({m['torch_threads']} threads), "
            f"load avg start {m['load_average_start']} end {end}, {m['started_utc']}"
        )

    def _markdown(self) -> str:
        lines = [f"# {self.name}", "", self._meta_line(), "", f"args: `{json.dumps(self.args)}`", ""]
        for s in self.sections:
            lines += [f"## {s['title']}", "", *markdown_table(s["columns"], [[_fmt(v) for v in r] for r in s["rows"]])]
            lines += ["", s["note"], ""] if s["note"] else [""]
        lines += [f"- {n}" for n in self.meta["notes"]]
        return "\n".join(lines) + "\n"


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


# ----------------------------------------------------------------------------- heads trained on a real dataset
# data_fp8_acceptance and train_loss_weighting train whole heads with the pipeline's own
# stages (peagle.stages.train_head: the launcher, DeepSpeed, one rank) and measure them
# with its offline acceptance on the held-out split.

REPO = Path(__file__).resolve().parent.parent


OFFLINE_NOTE = ("offline acceptance: peagle.stages.evaluate_offline of each run's last checkpoint (the served "
                "split: the eval prompts with the target's greedy tokens, walked as vLLM decodes)")


def head_parser(doc: str):
    """An argument parser with the options of every head-training benchmark (``doc``: the script's docstring)."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"))
    parser.add_argument("--data-dir", default=None, help="a built dataset (default: the config's run dir / data)")
    parser.add_argument("--epochs", type=int, default=None, help="override train.recipe.epochs (default: the config's)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads here and OMP_NUM_THREADS of the training processes "
                             "(1: fastest on shared, busy cores)")
    return parser


def epochs_override(epochs: int | None) -> dict:
    """``--epochs N``: N whole epochs instead of the config's training length, a clock included
    (the demo's config trains for ``train.recipe.max_train_seconds``)."""
    return {"train.recipe.epochs": epochs, "train.recipe.max_train_seconds": None} if epochs else {}


def setup_head_bench(threads: int) -> None:
    from peagle.paths import configure_environment

    configure_environment()
    os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by the training launcher's processes
    torch.set_num_threads(threads)


def target_info(target_path: str | Path, data_dir: Path):
    """The ``TargetInfo`` the pipeline stages take: the target's directory and the dataset's target facts."""
    from peagle.facts import load_dataset_facts
    from peagle.layout import DataLayout
    from peagle.stages import TargetInfo

    return TargetInfo(path=str(target_path), facts=load_dataset_facts(DataLayout(data_dir)))


def train_fresh(cfg, target, data_dir: Path, mlflow_run_id: str | None = None):
    """A fresh training run (old checkpoints removed so nothing resumes): (TrainResult, wall seconds).
    ``mlflow_run_id``: an MLflow run (in ``cfg.tracking``'s store) its step metrics stream to."""
    import shutil

    from peagle.stages import plan_head, train_head

    plan = plan_head(cfg, cfg.train.method, data_dir)
    shutil.rmtree(plan.checkpoint_dir, ignore_errors=True)
    start = time.perf_counter()
    result = train_head(plan, target, mlflow_run_id=mlflow_run_id)
    return result, time.perf_counter() - start


def offline_acceptance(cfg, target, data_dir: Path, checkpoint: Path) -> dict:
    """``peagle.stages.evaluate_offline`` of a checkpoint on ``data_dir``'s eval split, as JSON-ready numbers."""
    from peagle.stages import evaluate_offline

    off = evaluate_offline(cfg, target, data_dir, Path(checkpoint))
    return {"acceptance_length": {str(k): v for k, v in off.acceptance_length.items()},
            "per_position": off.per_position, "num_anchors": off.num_anchors, "offline_split": off.split,
            "ngram_acceptance_length": {str(k): v for k, v in off.ngram_acceptance_length.items()},
            "versus_ngram": off.versus_ngram}


def train_settings(train, threads: int) -> dict:
    """What a head-training result records about its training budget."""
    return {"threads": threads, "epochs": train.recipe.epochs, "max_steps": train.recipe.max_steps, "seed": train.recipe.seed,
            "k_train": train.peagle.k_train, "lr": train.recipe.learning_rate, "micro_batch_size": train.recipe.micro_batch_size,
            "grad_accum": train.grad_accum}


def train_note(t: dict) -> str:
    """The training line of a head benchmark's notes, from ``train_settings``."""
    return (f"training: peagle.stages.train_head, {t['epochs']} epoch(s), lr {t['lr']}, micro batch "
            f"{t['micro_batch_size']} x accum {t['grad_accum']}, K_train {t['k_train']}, "
            f"OMP_NUM_THREADS={t.get('threads')}")


def tiny_head_dataset(root: Path, num_train: int = 12, num_eval: int = 4, draft_vocab: int = 96,
                      prompt_len: int = 8, response_len: int = 40, seed: int = 0) -> tuple[Path, Path]:
    """(data_dir, target_dir): a tiny random Llama and a dataset of its own greedy continuations.

    For ``--quick`` runs and smoke tests on a clean checkout (no built demo dataset, no
    embedded target): 8 layers x 64, random prompt tokens (unsupervised), the target's
    greedy response (supervised), float32 hidden states of the stored layers from
    transformers, a draft vocabulary of the most frequent train-response tokens.
    """
    from transformers import LlamaForCausalLM

    from peagle.data.store import ShardWriter
    from peagle.data.vocab import build_draft_vocab
    from peagle.layout import DataLayout
    from peagle.testing.golden import build_tiny_target, tiny_target_facts
    from peagle.testing.tiny import SPECIAL_TOKENS

    target = build_tiny_target(root / "target", num_layers=8, hidden_size=64, seed=seed)
    facts = tiny_target_facts(target, draft_vocab_size=draft_vocab)
    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(facts.vocab_size, dtype=torch.int64)
    data = DataLayout(root / "data")
    for split, count in (("train", num_train), ("eval", num_eval)):
        with ShardWriter(data.split(split), facts.stored_layer_ids, facts.target_hidden_size, "float32",
                         1 << 16) as writer:
            for i in range(count):
                prompt = torch.randint(len(SPECIAL_TOKENS), facts.vocab_size, (1, prompt_len), generator=g)
                with torch.no_grad():
                    ids = model.generate(prompt, max_new_tokens=response_len, min_new_tokens=response_len,
                                         do_sample=False)
                    states = model(ids, output_hidden_states=True).hidden_states
                mask = torch.arange(ids.shape[1]) >= prompt_len
                writer.add(f"{split}-{i}", ids[0], mask, torch.stack([states[k][0] for k in facts.stored_layer_ids], 1))
                if split == "train":
                    counts += torch.bincount(ids[0][mask], minlength=facts.vocab_size)
    build_draft_vocab(counts, draft_vocab).save(data.vocab)
    facts.save(data.facts)
    return data.root, target


# ----------------------------------------------------------------------------- a cell in its own process


def rss_gib(pid: int) -> float:
    """A live process's resident memory (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    except FileNotFoundError:
        pass
    return 0.0


def run_capped(cmd: list[str], threads: int, mem_cap: float, time_cap: float, poll_s: float,
               over_memory: str, over_time: str) -> dict:
    """Run a bench cell in a fresh interpreter, killed past ``mem_cap`` GiB of RSS or ``time_cap`` s:
    ``{"status": "ok", **its last stdout line as JSON}``, or the status that says why not
    (``over_memory``/``over_time`` formatted with ``cap`` and the ``rss`` seen)."""
    import subprocess

    env = {**os.environ, "PEAGLE_BENCH_THREADS": str(threads)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    start, seen = time.monotonic(), 0.0
    while proc.poll() is None:
        seen = max(seen, rss_gib(proc.pid))
        reason = (over_memory.format(cap=mem_cap, rss=seen) if seen > mem_cap else
                  over_time.format(cap=time_cap, rss=seen) if time.monotonic() - start > time_cap else None)
        if reason:
            proc.kill()
            proc.wait()
            return {"status": reason}
        time.sleep(poll_s)
    out, err = proc.communicate()
    if proc.returncode != 0:
        return {"status": f"failed: {err.strip().splitlines()[-1] if err.strip() else proc.returncode}"}
    return {"status": "ok", **json.loads(out.strip().splitlines()[-1])}
