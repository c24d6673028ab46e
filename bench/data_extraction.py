"""Hidden-state extraction throughput through our connector vs plain vLLM prefill.

Both engines get the SAME token sequences (a built dataset's train + eval samples) in
batches of ``data.extract_batch_size``:
- plain: ``vllm.LLM`` from ``open_llm`` (no speculation, no connector), each sequence a
  prompt with ``SamplingParams(max_tokens=1)``: the floor cost of one prefill;
- extraction: ``open_data_engine`` + ``extract_with_engine`` (vLLM's
  ``extract_hidden_states`` + ``PeagleHiddenStatesConnector``), end to end: prefill,
  capture, file write, read back, token check, delete.
Each engine first runs a warm-up pass on random sequences of the same lengths (no
prefix-cache overlap with the timed pass), then one timed pass. Engine start-up is reported apart from throughput.

    .venv/bin/python bench/data_extraction.py [--data-dir DIR] [--config configs/demo.yaml]

Results go to ``results/data_extraction.*`` for the demo's config and to
``results/data_extraction_<config>.*`` for another (one file per target).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from peagle.layout import SPLITS, DataLayout, RunLayout

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_common import render_saved, report, started  # noqa: E402
from result_files import per_target_name  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
NAME = "data_extraction"


def load_sequences(data_dir: Path) -> list[tuple[str, list[int]]]:
    """(sample id, token ids) of every stored sample, read without touching hidden states."""
    from peagle.data.store import ShardReader

    out = []
    for split in SPLITS:
        reader = ShardReader(DataLayout(data_dir).split(split), verify=False)
        ids, lengths = reader.sample_ids(), reader.lengths()
        tokens = torch.cat([t for t, _ in reader.iter_tokens()])
        for sid, piece in zip(ids, tokens.split(lengths), strict=True):
            out.append((sid, piece.tolist()))
    return out


def warmup_sequences(sequences, vocab_size: int, count: int | None = None, seed: int = 0) -> list[tuple[str, list[int]]]:
    """Random sequences as long as the first ``count`` real ones (default: all): warm kernels, share no prefix.

    A warm-up of every length matters: with 8 sequences the plain engine's first timed pass
    ran 12% slower than its second with prefix caching off (per-shape kernel set-up), which
    the extraction engine's first pass did not show.
    """
    g = torch.Generator().manual_seed(seed)
    return [(f"warmup-{i}", torch.randint(4, vocab_size, (len(ids),), generator=g).tolist())
            for i, (_, ids) in enumerate(sequences[:count])]


def batches(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i : i + size]


def plain_prefill(llm, sequences, batch_size: int) -> None:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    for batch in batches(sequences, batch_size):
        llm.generate([{"prompt_token_ids": ids} for _, ids in batch], params, use_tqdm=False)


def extraction_pass(llm, sequences, batch_size: int) -> tuple[int, float]:
    """Tokens extracted, and seconds spent inside the engine's generate call.

    The rest of the pass is ours: waiting for the connector's files, loading, checking
    and deleting them. The split comes from timing the real ``request_hidden_states``.
    """
    import peagle.serving.extraction as extraction
    from peagle.data.extract import extract_with_engine

    request = extraction.request_hidden_states
    engine_s = 0.0

    def timed_request(llm, prompts):
        nonlocal engine_s
        start = time.perf_counter()
        try:
            return request(llm, prompts)
        finally:
            engine_s += time.perf_counter() - start

    extraction.request_hidden_states = timed_request
    try:
        tokens = 0
        for _, hidden in extract_with_engine(llm, sequences, batch_size=batch_size, progress=False):
            tokens += hidden.shape[0]
    finally:
        extraction.request_hidden_states = request
    return tokens, engine_s


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_plain(target: str, cfg, sequences, warm, batch_size: int) -> dict:
    from peagle.serving import open_llm

    start = time.perf_counter()
    with open_llm(target, cfg.vllm, dtype=cfg.target.dtype) as llm:
        startup = time.perf_counter() - start
        warm_s = timed(lambda: plain_prefill(llm, warm, batch_size))
        seconds = timed(lambda: plain_prefill(llm, sequences, batch_size))
        dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
        scheduler = scheduler_settings(llm)
    return {"startup_s": startup, "warmup_s": warm_s, "seconds": seconds, "dtype": dtype, "scheduler": scheduler}


def scheduler_settings(llm) -> str:
    """What decides how prefill is batched: the scheduler's token and sequence budgets, chunked prefill, prefix caching."""
    config = llm.llm_engine.vllm_config
    s = config.scheduler_config
    return (f"max_num_batched_tokens {s.max_num_batched_tokens}, max_num_seqs {s.max_num_seqs}, "
            f"chunked prefill {s.enable_chunked_prefill}, prefix caching {config.cache_config.enable_prefix_caching}")


def run_extraction(target: str, cfg, layer_ids, work_dir: Path, sequences, warm, batch_size: int) -> dict:
    from peagle.data.extract import open_data_engine

    start = time.perf_counter()
    with open_data_engine(target, cfg.vllm, layer_ids, work_dir, dtype=cfg.target.dtype) as llm:
        startup = time.perf_counter() - start
        warm_s = timed(lambda: extraction_pass(llm, warm, batch_size))
        scheduler = scheduler_settings(llm)
        got = {}
        seconds = timed(lambda: got.update(zip(("tokens", "engine_s"), extraction_pass(llm, sequences, batch_size))))
    expected = sum(len(ids) for _, ids in sequences)
    if got["tokens"] != expected:
        raise RuntimeError(f"extraction returned hidden states for {got['tokens']} tokens, expected {expected}")
    return {"startup_s": startup, "warmup_s": warm_s, "seconds": seconds, "scheduler": scheduler,
            "engine_generate_s": got["engine_s"], "file_read_check_s": seconds - got["engine_s"]}


def same_scheduler(plain: dict, extraction: dict) -> str:
    """The engines' scheduler settings, refused when they differ (the ratio would compare two budgets)."""
    if plain["scheduler"] != extraction["scheduler"]:
        raise RuntimeError(f"the engines batch prefill differently: plain {plain['scheduler']}, "
                           f"extraction {extraction['scheduler']}")
    return plain["scheduler"]


def tables(result: dict) -> list:
    plain = result["plain"]["tokens_per_s"]
    rows = [[name, f"{r['startup_s']:.1f}", f"{r['seconds']:.2f}", f"{r['tokens_per_s']:.0f}", f"{r['tokens_per_s'] / plain:.3f}"]
            for name, r in (("plain vLLM prefill", result["plain"]), ("extraction (connector)", result["extraction"]))]
    return [(f"Extraction vs plain prefill, same {result['num_sequences']} sequences / {result['num_tokens']} tokens, "
             f"batch {result['batch_size']}", ["engine", "start-up s", "pass s", "tokens/s", "x plain"], rows)]


def notes(result: dict) -> list[str]:
    e = result["extraction"]
    return [
        f"target {Path(result['target']).name} (hidden {result['hidden_size']}), layers {result['layer_ids']}, "
        f"engine dtype {result['engine_dtype']}; sequences: the demo dataset's train + eval samples",
        f"extraction pass split: {e['engine_generate_s']:.2f} s inside the engine's generate, "
        f"{e['file_read_check_s']:.2f} s waiting for / loading / checking / deleting the connector's files",
        "start-up: LLM() construction (model load, KV cache, profiling); one warm-up pass per engine on random "
        f"sequences of the same lengths before the timed pass; "
        f"both engines: {result.get('scheduler', 'scheduler as configured')}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"))
    parser.add_argument("--data-dir", default=None, help="a built dataset (default: the config's run dir / data)")
    parser.add_argument("--max-sequences", type=int, default=None)
    parser.add_argument("--render-only", action="store_true", help="re-print results/data_extraction.json")
    args = parser.parse_args()
    name = per_target_name(NAME, args.config)
    if args.render_only:
        render_saved(name, tables, notes)
        return

    from targets import bench_target

    from peagle.config import load_config
    from peagle.paths import configure_environment, peagle_home

    configure_environment()
    cfg = load_config(args.config)
    data_dir = Path(args.data_dir) if args.data_dir else RunLayout(cfg.run_dir).data.root
    target = bench_target(cfg.target)
    manifest = json.loads(DataLayout(data_dir).manifest("train").read_text())
    layer_ids = manifest["layer_ids"]
    sequences = load_sequences(data_dir)[: args.max_sequences]
    vocab_size = json.loads(DataLayout(data_dir).facts.read_text())["vocab_size"]
    warm = warmup_sequences(sequences, vocab_size)
    batch_size = cfg.data.extract_batch_size
    num_tokens = sum(len(ids) for _, ids in sequences)
    print(f"{len(sequences)} sequences, {num_tokens} tokens, layers {layer_ids}, target {target}")

    stamp = started()
    plain = run_plain(target, cfg, sequences, warm, batch_size)
    extraction = run_extraction(target, cfg, layer_ids, peagle_home() / "bench" / "data_extraction",
                                sequences, warm, batch_size)
    for r in (plain, extraction):
        r["tokens_per_s"] = num_tokens / r["seconds"]
    result = {
        "benchmark": name,
        **stamp,
        "target": target,
        "engine_dtype": plain.pop("dtype"),
        "scheduler": same_scheduler(plain, extraction),
        "data_dir": str(data_dir),
        "layer_ids": layer_ids,
        "hidden_size": manifest["hidden_size"],
        "batch_size": batch_size,
        "num_sequences": len(sequences),
        "num_tokens": num_tokens,
        "plain": plain,
        "extraction": extraction,
        "throughput_ratio_extraction_over_plain": extraction["tokens_per_s"] / plain["tokens_per_s"],
    }
    report(name, result, tables(result), notes(result))


if __name__ == "__main__":
    main()
