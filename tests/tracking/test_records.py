"""What the evaluate stage's run holds in MLflow: metrics named for the figure they are, and the plot."""

from __future__ import annotations

import pytest

from peagle.contract import NGRAM
from peagle.publish.records import record_online
from peagle.tracking.mlflow_run import Tracker
from tests.eval.test_online import measured_with_ngram


def test_online_metrics_name_tokens_per_step_and_vllms_acceptance_length(tracking, pipeline_cfg, tmp_path):
    """Heads and n-gram lookup on tokens per target step under one name; vLLM's acceptance length
    under its own, so no chart reads n-gram lookup's vLLM figure as a per-step one."""
    online = measured_with_ngram()
    with Tracker(tracking, "org/records-target", pipeline_cfg) as tracker, tracker.stage("evaluate") as run:
        png = record_online(run, online, tmp_path / "eval")
    client = tracker.client
    stage = next(r for r in client.search_runs([tracker.experiment_id], f"tags.mlflow.parentRunId = '{tracker.run_id}'")
                 if r.info.run_name == "evaluate")
    metrics = stage.data.metrics
    # the first prompt set, unprefixed, and every set under its name
    assert metrics["ngram_tokens_per_step_k3"] == pytest.approx(2.75)
    assert metrics["ngram_min_tokens_per_step_k3"] == pytest.approx(396 / 156)
    assert metrics["ngram_vllm_acceptance_length_k3"] == pytest.approx(2.9)
    assert metrics["p-eagle_tokens_per_step_k3"] == pytest.approx(2.6) == metrics["p-eagle_vllm_acceptance_length_k3"]
    assert metrics["chat_ngram_tokens_per_step_k3"] == pytest.approx(1.1)
    assert metrics["chat_ngram_min_tokens_per_step_k3"] == pytest.approx(396 / 372)
    assert metrics["chat_ngram_vllm_acceptance_length_k3"] == pytest.approx(1.4)
    assert metrics["chat_p-eagle_tokens_per_step_over_ngram_k3"] == pytest.approx(2.0)
    assert metrics["code_eval_eagle-3_tokens_per_step_k1"] == pytest.approx(1.6)
    # no metric calls vLLM's figure an acceptance length without saying whose count it is
    assert not [name for name in metrics if name.endswith(tuple(f"acceptance_length_k{k}" for k in (1, 3)))
                and "vllm_acceptance_length" not in name]
    history = client.get_metric_history(stage.info.run_id, f"{NGRAM}_tokens_per_step")
    assert sorted((m.step, round(m.value, 3)) for m in history) == [(1, 1.2), (3, 2.75)]  # a curve over K
    assert png.name == "online_acceptance.png" and png.stat().st_size > 20_000
    assert {a.path for a in client.list_artifacts(stage.info.run_id)} >= {"online_acceptance.png", "online_results.json"}
