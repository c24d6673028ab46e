"""vLLM on a CPU: the target decoding in bfloat16 against float32.

``target.dtype: auto`` runs an engine in the model's own dtype, except on an x86 CPU without
native bfloat16 (``peagle.serving.engine.engine_dtype``), where it runs in float32. This
measures why, on the config's target: for each round, both dtypes (the order alternating per
round) in one engine each, as the data stage and the evaluation use them:
- batch decode: ``--prompts`` of the config's prompt requests answered at once, greedy, up to
  ``data.regenerate.max_tokens`` each (what regeneration and Magpie synthesis do);
- one request at a time: the first 4 of them, ``eval.max_tokens`` each (what the evaluation's
  concurrency 1 measures).
Reported per dtype: engine start, output tokens/s of each; then float32 over bfloat16 per round.

    .venv/bin/python bench/cpu_dtype.py [--config configs/demo.yaml] [--prompts 32] [--rounds 2]
    .venv/bin/python bench/cpu_dtype.py --render-only

Results go to ``results/cpu_dtype.*`` for the demo's config, ``results/cpu_dtype_<config>.*`` for another.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_common import render_saved, report, started  # noqa: E402
from result_files import per_target_name  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
NAME = "cpu_dtype"
DTYPES = ("bfloat16", "float32")
SINGLE_REQUESTS = 4


def prompt_requests(cfg, count: int) -> list[list[dict]]:
    """The first ``count`` chat requests of the config's prompt files (``load_jsonl_prompts``'s user turns)."""
    from peagle.data.prompt_sets import load_jsonl_prompts

    out = []
    for source in cfg.data.sources:
        if source.kind in ("jsonl", "magpie") and Path(source.path).exists():
            out += [p for p in load_jsonl_prompts(Path(source.path), count - len(out)) if not isinstance(p, str)]
        if len(out) >= count:
            return out[:count]
    raise SystemExit(f"the config's prompt files hold {len(out)} chat requests, fewer than --prompts {count}")


def decode_rate(llm, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    """Output tokens and seconds for ``prompts`` answered greedily in one batch."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - start


def measure(cfg, target: str, dtype: str, prompts: list[list[int]]) -> dict:
    from peagle.serving import open_llm

    start = time.perf_counter()
    with open_llm(target, cfg.vllm, dtype=dtype) as llm:
        startup = time.perf_counter() - start
        decode_rate(llm, prompts[:1], 8)  # kernels warm before either timing
        batch_tokens, batch_s = decode_rate(llm, prompts, cfg.data.regenerate.max_tokens)
        single_tokens, single_s = 0, 0.0
        for p in prompts[:SINGLE_REQUESTS]:
            n, s = decode_rate(llm, [p], cfg.eval.max_tokens)
            single_tokens, single_s = single_tokens + n, single_s + s
    return {"dtype": dtype, "startup_s": round(startup, 1),
            "batch_tokens": batch_tokens, "batch_tok_s": round(batch_tokens / batch_s, 1),
            "single_tokens": single_tokens, "single_tok_s": round(single_tokens / single_s, 1)}


def tables(result: dict):
    runs = result["runs"]
    rows = [[str(r["round"]), r["dtype"], f"{r['startup_s']:.1f}", f"{r['batch_tok_s']:.1f}", f"{r['single_tok_s']:.1f}"]
            for r in runs]
    ratios = []
    for rnd in sorted({r["round"] for r in runs}):
        by = {r["dtype"]: r for r in runs if r["round"] == rnd}
        ratios.append([str(rnd), f"{by['float32']['batch_tok_s'] / by['bfloat16']['batch_tok_s']:.2f}x",
                       f"{by['float32']['single_tok_s'] / by['bfloat16']['single_tok_s']:.2f}x"])
    return [
        (f"vLLM decode on this CPU, {result['target']} ({result['prompts']} requests at once, "
         f"{SINGLE_REQUESTS} one at a time)",
         ["round", "dtype", "engine start s", "batch decode tok/s", "one request tok/s"], rows),
        ("float32 over bfloat16", ["round", "batch decode", "one request"], ratios),
    ]


def notes(result: dict) -> list[str]:
    flags = result.get("native_bf16_flags") or "none"
    return [f"CPU: {result.get('cpu_model')}; native bfloat16 flags: {flags}.",
            "Both dtypes get the same prompt token ids, greedy; their answers differ in places, so each rate "
            "counts its own answers' tokens.",
            "Each ratio is taken within one round: the cores are shared."]


def cpu_facts() -> tuple[str | None, str]:
    """The CPU's model name and the native bfloat16 flags it lists."""
    from peagle.serving.engine import NATIVE_BF16_FLAGS, cpu_flags

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), None)
    flags = cpu_flags() or []
    return model, ", ".join(f for f in NATIVE_BF16_FLAGS if f in flags)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=REPO / "configs/demo.yaml")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--render-only", action="store_true")
    args = ap.parse_args()
    name = per_target_name(NAME, args.config)
    if args.render_only:
        return render_saved(name, tables, notes)

    from transformers import AutoTokenizer

    from peagle.config import load_config
    from peagle.serving.engine import is_cpu_platform

    if not is_cpu_platform():
        raise SystemExit("this benchmark measures vLLM on a CPU; this vLLM build runs on a GPU")
    cfg = load_config(args.config)
    target = str((REPO / cfg.target.model).resolve()) if cfg.target.model.startswith(".") else cfg.target.model
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
               for m in prompt_requests(cfg, args.prompts)]
    result = started() | {"target": cfg.target.model, "prompts": args.prompts, "runs": []}
    result["cpu_model"], result["native_bf16_flags"] = cpu_facts()
    for rnd in range(args.rounds):
        for dtype in (DTYPES if rnd % 2 == 0 else DTYPES[::-1]):
            run = measure(cfg, target, dtype, prompts) | {"round": rnd}
            print(json.dumps(run), flush=True)
            result["runs"].append(run)
    report(name, result, tables(result), notes(result))


if __name__ == "__main__":
    main()
