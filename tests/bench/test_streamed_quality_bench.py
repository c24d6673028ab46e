"""The streamed quality benchmark's numbers: answers seen, the curve, and the head's rows against
n-gram lookup and the per-position bounds, read from what the pipeline writes."""

import json
from pathlib import Path

from peagle.eval.online import BASELINE, OnlineResult, OnlineRow
from tests.support.bench import load_bench


def write_metrics(path: Path) -> Path:
    """Six one-sample steps, evaluated after the 3rd and 6th, as rank 0's metrics.jsonl has them."""
    lines = []
    for step in range(1, 7):
        lines.append({"step": step, "samples": [step - 1], "tokens": 100, "step_time_s": 0.5, "loss": 1.0})
        if step % 3 == 0:
            lines.append({"step": step, "eval/acceptance": 1.1 * step / 3})
    path.write_text("\n".join(map(json.dumps, lines)) + "\n")
    return path


def row(method: str, k: int, decode: int, accepted: int, drafts: int, tok_s: float, per_position=()) -> OnlineRow:
    return OnlineRow(method=method, k=k, concurrency=1, requests=4, output_tokens=decode + 4, wall_s=1.0,
                     output_tokens_per_s=tok_s, num_drafts=drafts, num_draft_tokens=drafts * k,
                     num_accepted_tokens=accepted, per_position_acceptance=list(per_position))


def test_answers_seen_and_the_curve_come_from_each_steps_samples(tmp_path):
    bench = load_bench("streamed_quality")
    metrics = write_metrics(tmp_path / "metrics.jsonl")
    assert bench.learning_curve(metrics) == [{"step": 3, "answers_seen": 3, "acceptance": 1.1},
                                             {"step": 6, "answers_seen": 6, "acceptance": 2.2}]
    assert bench.training_numbers(metrics) == {"steps": 6, "answers_seen": 6, "step_seconds": 3.0, "tokens_per_s": 200.0}


def test_the_head_is_compared_with_ngram_lookup_and_the_bounds_on_each_prompt_set(tmp_path):
    bench = load_bench("streamed_quality")
    # HumanEval: the head at 1.5 tokens a step, n-gram lookup at most 1.2; chat: the head ties it at 1.2
    humaneval = OnlineResult(target="t", max_tokens=100, prompt_set="humaneval", rows=[
        row(BASELINE, 0, 96, 0, 0, 10.0),
        row("ngram", 3, 96, 16, 20, 11.0),
        row("p-eagle", 3, 96, 32, 64, 12.0, (0.5, 0.12, 0.02))])
    chat = OnlineResult(target="t", max_tokens=100, prompt_set="chat", rows=[
        row(BASELINE, 0, 96, 0, 0, 10.0),
        row("ngram", 3, 96, 16, 20, 11.0),
        row("p-eagle", 3, 96, 16, 80, 9.0, (0.4, 0.1, 0.0))])
    humaneval.more_sets = [chat]
    rows = bench.online_rows(humaneval.save(tmp_path / "online_results.json"))
    assert [(r["prompt_set"], r["k"], r["tokens_per_step"], r["ngram_tokens_per_step"]) for r in rows] == [
        ("humaneval", 3, 1.5, 1.2), ("chat", 3, 1.2, 1.2)]
    result = {"online": rows, "answers": 6, "training": bench.training_numbers(write_metrics(tmp_path / "m.jsonl")),
              "curve": [], "seconds": {"data": 60.0, "train": 120.0}}
    online, training, wall = bench.tables(result)
    by_set = {r[0]: r for r in online[2]}
    # per position at or above 0.45 / 0.10 / 0.01, tokens per step above n-gram lookup's most
    # (n-gram lookup's range: up to 3 accepted draft tokens of each of its 4 requests may lie past the end)
    assert by_set["humaneval"][2:7] == ["0.50 0.12 0.02", "yes", "1.50", "1.04-1.20", "yes"]
    assert by_set["chat"][2:7] == ["0.40 0.10 0.00", "no", "1.20", "1.04-1.20", "no"]
    assert wall[2][-1] == ["total", "180", "3.0"]
    assert "6 answers seen (1.00 epochs)" in training[0]
