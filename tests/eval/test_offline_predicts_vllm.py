"""Offline acceptance predicts vLLM's: the shared pipeline run's heads, simulated on the
dataset's served split, against what vLLM measured for them at every K the run evaluated."""

from __future__ import annotations

from pathlib import Path

import pytest

from peagle import stages
from peagle.catalogue import describe
from peagle.config import load_config
from peagle.layout import BEST, RunLayout

pytestmark = pytest.mark.slow

TOLERANCE = 0.05  # offline acceptance predicts vLLM's within 5% at every K


def pipeline_checkpoint(run_dir: Path, method: str) -> Path:
    """The ``method`` head the pipeline trained first (later tests train beside it on grown data)."""
    from peagle.checkpoint_format import resolve_checkpoint

    pointers = sorted(RunLayout(run_dir).method_checkpoints(method).glob(f"*/{BEST}"), key=lambda p: p.stat().st_mtime)
    assert pointers, f"the shared run trained no {method} head"
    return resolve_checkpoint(pointers[0])


def test_offline_acceptance_matches_vllm_on_both_heads(pipeline_run):
    result = pipeline_run.result
    cfg = load_config(pipeline_run.config, pipeline_run.overrides)
    online = result.online
    compared = 0
    for method in ("peagle", "eagle3"):
        label = describe(method).label
        measured = online.acceptance_by_k(label)
        assert measured, f"the shared run has no online rows for {label}"
        checkpoint = pipeline_checkpoint(cfg.run_dir, method)
        offline = stages.evaluate_offline(cfg, None, Path(result.data_dir), checkpoint, method=method)
        assert offline.split == "served"  # the eval prompts as vLLM decoded them, not the held-out split
        row = next(r for r in online.rows if r.method == label and r.k == max(measured))
        assert offline.num_drafts[row.k] == pytest.approx(row.num_drafts, rel=TOLERANCE)  # the same decoding walk
        for k, vllm in measured.items():
            simulated = offline.acceptance_length[k]
            print(f"{label} K={k}: offline {simulated:.3f} vLLM {vllm:.3f} ({simulated / vllm - 1:+.1%})")
            assert simulated == pytest.approx(vllm, rel=TOLERANCE), (label, k, offline.acceptance_length, measured)
            compared += 1
    assert compared >= 2


def test_card_reports_acceptance_on_chat_and_completion_traffic(pipeline_run):
    """tiny.yaml's eval.completion_prompts: the same engines measured on raw code, no chat template."""
    result = pipeline_run.result
    completion = result.online.completion
    assert completion is not None and completion.prompt_set == "code_completion_eval"
    for label in ("p-eagle", "eagle-3"):
        rows = [r for r in completion.rows if r.method == label]
        assert rows and all(r.num_draft_tokens > 0 and r.acceptance_length > 1.0 for r in rows)
    card = (Path(result.head_dir) / "README.md").read_text()
    chat, raw = card.split("### On code_completion_eval (completion traffic: raw documents, no chat template)")
    assert "prompt set code_eval," in chat and "prompt set code_completion_eval," in raw
    k = max(completion.acceptance_by_k("p-eagle"))
    assert f"| {k} | {completion.acceptance_by_k('p-eagle')[k]:.2f} | {completion.acceptance_by_k('eagle-3')[k]:.2f} |" in raw
