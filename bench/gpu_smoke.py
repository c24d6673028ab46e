"""GPU smoke benchmark: the trainer at an 8B shape on one GPU, inside a short lease.

For a bare GPU box with CUDA torch and transformers and no network (peagle's other pure-Python
needs, DeepSpeed among them, travel as wheels: `bench/gpu_wheels.sh`). On synthetic hidden
states at Llama-3.1-8B's shape (Ht 4096, 32 query heads of 128 sharing 8 KV heads, MLP 14336),
a 4-layer drafter, draft vocabulary 32K, K_train 8, COD ratio 0.8, it measures:

1. **Training steps**: one optimizer step of the trainer's own micro-batch
   (``peagle.train.trainer.run_micro_batch``) under DeepSpeed ZeRO-2 on one GPU in bf16, for
   8K / 16K / 32K tokens x segments S in {1, 2, 4, 8}, with the attention rule evaluated by
   flex attention's block mask and by the dense mask: tokens/s and peak GPU memory. Each backend
   runs in a process of its own, built once; a cell runs one step to warm up and times the
   next. A cell out of memory is recorded as such, and that S is not tried at longer lengths.
   The backends share ``--budget-s`` (each gets an equal part of what is left when it starts;
   a backend's process that runs past its part is stopped, and its cells still to run are
   recorded as not measured), so the script ends inside a short lease.
2. **Drafting**: one P-EAGLE pass against K sequential EAGLE-3 passes, K = 1..11, batch 1,
   a 512-token context (``bench/train_forward_latency.py``'s passes, on the GPU in bf16).

Results go to ``bench/results/<gpu>/gpu_smoke.{json,md}`` (e.g. ``results/h200/``;
``--optimizer muon``: ``gpu_smoke_muon``). ``peagle config check`` prices a GPU config's
training from these rates (``peagle.train.gpu_hours``). It fits
about 8 minutes on one H100 or H200 (``--budget-s`` bounds the training cells); never
required by the tests, which run its ``--quick`` form on CPU (a tiny shape, the dense mask,
fp32) to keep it working.

    bash bench/gpu_wheels.sh                # here, once: the wheels the GPU box lacks, into .whl/
    python bench/gpu_smoke.py               # there (below)
    python bench/gpu_smoke.py --quick       # anywhere: the CPU smoke

On a lent GPU machine, one call that carries `.whl` runs it, and the GPU tests beside it
(``PEAGLE_BENCH_COMMIT``: the commit the copied tree is at; the git that travels with it can be stale):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 PEAGLE_BENCH_COMMIT=<commit> &&
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/model/test_flex_attention.py;
    python3 bench/gpu_smoke.py; cp bench/results/*/gpu_smoke.* $OUT/
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from peagle.config import TrainConfig  # noqa: E402
from peagle.facts import HeadSpec  # noqa: E402
from peagle.methods import get_method  # noqa: E402
from peagle.model import PEagleDrafter  # noqa: E402
from peagle.objective.loss import TargetHead  # noqa: E402
from peagle.train.engine import build_engine, init_process_group  # noqa: E402
from peagle.train.trainer import StepStats, make_objective, run_micro_batch  # noqa: E402

from train_common import Run, synthetic_sample  # noqa: E402
from train_forward_latency import measure_spec  # noqa: E402

NAME = "gpu_smoke"
K_TRAIN, COD_RATIO = 8, 0.8
LENGTHS, SEGMENTS, BACKENDS = [8192, 16384, 32768], [1, 2, 4, 8], ["flex", "dense"]
QUICK_LENGTHS, QUICK_SEGMENTS = [256, 512], [1, 2]
DRAFT_KS, DRAFT_CONTEXT = list(range(1, 12)), 512


def llama8b_spec(quick: bool):
    """The head spec of a drafter for Llama-3.1-8B (or, ``quick``, the CPU smoke's tiny shape)."""
    if quick:
        hidden, heads, kv_heads, head_dim, mlp, vocab, draft_vocab = 128, 4, 2, 32, 256, 4096, 1024
    else:
        hidden, heads, kv_heads, head_dim, mlp, vocab, draft_vocab = 4096, 32, 8, 128, 14336, 128256, 32000
    return HeadSpec(
        target="synthetic-llama-3.1-8b-shape", target_revision=None, target_num_layers=32,
        target_hidden_size=hidden, vocab_size=vocab, aux_layer_ids=[2, 16, 29], final_layer_id=32,
        mask_token_id=3, hidden_size=hidden, num_layers=4, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, intermediate_size=mlp, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None,
        max_position_embeddings=1 << 17, draft_vocab_size=draft_vocab,
    )


# ----------------------------------------------------------------------------- training cells (one process a backend)


def train_cells(backend: str, lengths: list[int], segments: list[int], quick: bool, optimizer: str) -> None:
    """Every (length, S) cell of one attention backend in this process, printed as one JSON line each
    (``run_backend`` reads them)."""
    cuda = torch.cuda.is_available()
    spec = llama8b_spec(quick)
    train = TrainConfig(
        recipe={"max_len": max(lengths), "optimizer": optimizer, "learning_rate": 1e-4,
                "precision": "bf16" if cuda else "fp32", "micro_batch_size": 1, "batch_size": 1},
        peagle={"k_train": K_TRAIN, "cod_ratio": COD_RATIO}, launch={"attention": backend, "zero_stage": 2})
    init_process_group()
    torch.manual_seed(0)
    drafter = PEagleDrafter(spec)
    get_method(train.method).prepare_drafter(drafter, train)
    drafter.attention = backend
    engine = build_engine(drafter, train, total_steps=1000, world_size=1)
    engine.train()
    head = TargetHead(spec.target_hidden_size, spec.draft_vocab_size, spec.rms_norm_eps).to(engine.device)
    failed: set[int] = set()
    for length in lengths:
        for s in segments:
            if s in failed:
                cell = {"status": "skipped (out of memory at a shorter length)"}
            else:
                engine.set_train_batch_size(s)  # one optimizer step a micro-batch: S DeepSpeed micro-steps
                recipe = train.recipe.model_copy(update={"segments": s})
                cell = _train_cell(engine, train.model_copy(update={"recipe": recipe}), spec, head, length)
                if cell["status"] != "ok":
                    failed.add(s)
            cell.update(backend=backend, length=length, segments=s)
            print(json.dumps(cell), flush=True)


def _train_cell(engine, train, spec, head, length: int) -> dict:
    """One warm-up step, then one timed step, of ``length`` tokens at ``train.recipe.segments``."""
    objective = make_objective(train, spec, head)
    cuda = engine.device.type == "cuda"

    def step(seed: int) -> float:
        example = objective.make_example(synthetic_sample(length, spec, seed), torch.Generator().manual_seed(seed))
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        run_micro_batch(engine, objective, [example], train.recipe.segments, 1, StepStats(objective.depths, engine.device))
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    try:
        step(1)  # compiles (flex) and allocates: not timed
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        steps = engine.global_steps
        seconds = step(2)
        if engine.global_steps != steps + 1:
            raise RuntimeError(f"one micro-batch of {train.recipe.segments} segments made {engine.global_steps - steps} "
                               "optimizer steps, not 1: DeepSpeed's accumulation is off")
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None
    except torch.OutOfMemoryError:
        engine.zero_grad()
        torch.cuda.empty_cache()
        return {"status": "out of memory"}
    return {"status": "ok", "step_s": seconds, "tokens_per_s": length / seconds, "peak_gib": peak,
            "peak_total_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}


def run_backend(backend: str, lengths: list[int], segments: list[int], quick: bool, optimizer: str,
                timeout_s: float) -> list[dict]:
    """``train_cells`` of one backend in a fresh process (a crash or a hang loses that backend's cells only)."""
    argv = [sys.executable, __file__, "--backend", backend, "--lengths", *map(str, lengths),
            "--segments", *map(str, segments), "--optimizer", optimizer] + (["--quick"] if quick else [])
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
        lines, tail = done.stdout.splitlines(), (done.stderr or "")[-1500:]
    except subprocess.TimeoutExpired as err:
        lines, tail = (err.stdout or b"").decode(errors="replace").splitlines(), f"timed out after {timeout_s:.0f} s"
    cells = [json.loads(line) for line in lines if line.startswith("{")]
    seen = {(c["length"], c["segments"]) for c in cells}
    for length in lengths:
        for s in segments:
            if (length, s) not in seen:
                cells.append({"backend": backend, "length": length, "segments": s,
                              "status": f"not measured: {tail.strip().splitlines()[-1] if tail.strip() else 'process ended'}"})
    return cells


# ----------------------------------------------------------------------------- drafting latency


def drafting_rows(quick: bool) -> list[list]:
    """One P-EAGLE pass vs K EAGLE-3 passes on this machine's device (bf16 on a GPU)."""
    cuda = torch.cuda.is_available()
    ks = [1, 4] if quick else DRAFT_KS
    return measure_spec(llama8b_spec(quick), 64 if quick else DRAFT_CONTEXT, ks, reps=2 if quick else 5,
                        device=torch.device("cuda" if cuda else "cpu"), dtype=torch.bfloat16 if cuda else torch.float32)


# ----------------------------------------------------------------------------- the run


def gpu_folder() -> str:
    """The results folder of this machine's GPU ('h200', 'h100', ...); '' on a CPU."""
    if not torch.cuda.is_available():
        return ""
    name = torch.cuda.get_device_name(0).lower()
    for model in ("h200", "h100", "a100", "l40s", "b200", "gb200"):
        if model in name:
            return model
    return name.replace("nvidia ", "").split()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the CPU smoke: a tiny shape, dense, fp32")
    parser.add_argument("--budget-s", type=float, default=360.0,
                        help="the training cells' seconds, shared by the backends")
    parser.add_argument("--backend", choices=BACKENDS, help=argparse.SUPPRESS)
    parser.add_argument("--backends", choices=BACKENDS, nargs="*", help="default: both on a GPU, dense on a CPU")
    parser.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw",
                        help="muon: results named gpu_smoke_muon")
    parser.add_argument("--lengths", type=int, nargs="*")
    parser.add_argument("--segments", type=int, nargs="*")
    args = parser.parse_args()
    lengths = args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS)
    segments = args.segments or (QUICK_SEGMENTS if args.quick else SEGMENTS)
    if args.backend:
        train_cells(args.backend, lengths, segments, args.quick, args.optimizer)
        return

    folder = gpu_folder()
    if not folder and not args.quick:
        parser.error("no CUDA device: run it on a GPU machine, or --quick for the CPU smoke")
    backends = args.backends or (BACKENDS if folder else ["dense"])  # no flex backward on CPU
    name = NAME if args.optimizer == "adamw" else f"{NAME}_{args.optimizer}"
    run = Run(f"{folder}/{name}" if folder else name, {
        "optimizer": args.optimizer, "lengths": lengths, "segments": segments, "backends": backends,
        "k_train": K_TRAIN, "cod_ratio": COD_RATIO, "quick": args.quick, "budget_s": args.budget_s,
        "drafting_ks": [1, 4] if args.quick else DRAFT_KS})
    start = time.monotonic()
    cells = []
    for i, backend in enumerate(backends):
        share = (args.budget_s - (time.monotonic() - start)) / (len(backends) - i)
        cells += run_backend(backend, lengths, segments, args.quick, args.optimizer, max(share, 30.0))
    drafting = drafting_rows(args.quick)
    precision = "bf16" if torch.cuda.is_available() else "fp32"
    run.add_table(
        f"One ZeRO-2 training step on one device, {precision}: tokens/s and peak memory by length, segments S "
        "and attention backend",
        ["backend", "tokens", "S", "tokens/s", "step s", "peak GiB over the model", "peak GiB in all", "status"],
        [[c["backend"], c["length"], c["segments"], c.get("tokens_per_s", "-"), c.get("step_s", "-"),
          c.get("peak_gib") if c.get("peak_gib") is not None else "-",
          c.get("peak_total_gib") if c.get("peak_total_gib") is not None else "-", c["status"]] for c in cells],
    )
    run.add_table(f"Drafting K tokens, batch 1, {precision}: one P-EAGLE pass vs K sequential EAGLE-3 passes",
                  ["H", "mode", "K", "P-EAGLE ms", "EAGLE-3 ms", "EAGLE-3 / P-EAGLE"], drafting)
    run.finish([
        "synthetic hidden states at Llama-3.1-8B's shape (Ht 4096, 32 heads x 128, 8 KV heads, MLP 14336), "
        f"4 drafter layers, draft vocabulary 32,000, K_train {K_TRAIN}, COD ratio {COD_RATIO}"
        if not args.quick else "the CPU smoke's tiny shape (H 128), dense mask, fp32: checks the script, measures nothing",
        f"training: the trainer's micro-batch (run_micro_batch) under DeepSpeed ZeRO-2, {args.optimizer}; one warm-up step "
        "per cell, then one timed step; peak = torch.cuda.max_memory_allocated over the timed step",
        "drafting: best of the repetitions, inference mode, masks built before timing (bench/train_forward_latency.py)",
    ])


if __name__ == "__main__":
    main()
