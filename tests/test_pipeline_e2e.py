"""The whole pipeline as one Prefect flow on the embedded default, for real.

vLLM regenerates and extracts, DeepSpeed trains, vLLM serves the exported head with
parallel drafting, MLflow records and registers it. The head must beat a random head
of the same shape served the same way.
"""

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent


def small_demo_overrides(tmp_path: Path) -> dict:
    """The demo config, shrunk so the flow fits a CI budget (same code paths)."""
    return {
        "name": "e2e",
        "workdir": str(tmp_path / "run"),
        "tracking.tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "data.max_samples": 160,
        "data.heldout_samples": 16,
        "data.regenerate.max_tokens": 128,
        "train.epochs": 1,
        "train.eagle3_baseline": True,
        "train.eagle3_ttt_steps": 3,
        "eval.ks": [3],
        "eval.num_prompts": 8,
        "eval.max_tokens": 64,
    }


@pytest.fixture(scope="module")
def pipeline_result(tmp_path_factory, embedded_target):
    from prefect.testing.utilities import prefect_test_harness

    from flows.pipeline import pipeline_flow

    tmp_path = tmp_path_factory.mktemp("e2e")
    with prefect_test_harness(server_startup_timeout=120):
        result = pipeline_flow(str(REPO / "configs" / "demo.yaml"), small_demo_overrides(tmp_path))
    return result, tmp_path


def test_flow_exports_a_head_vllm_serves(pipeline_result):
    result, _ = pipeline_result
    head = Path(result.head_dir)
    assert {"config.json", "model.safetensors", "README.md"} <= {p.name for p in head.iterdir()}
    rows = [r for r in result.online.rows if r.method == "p-eagle"]
    assert rows and all(r.num_draft_tokens > 0 for r in rows)
    assert rows[0].acceptance_length > 1.0
    baseline = [r for r in result.online.rows if r.method == "baseline"]
    assert baseline and baseline[0].output_tokens_per_s > 0
    assert "vllm serve" in (head / "README.md").read_text()
    assert Path(result.plot).stat().st_size > 0


def test_flow_compares_with_an_eagle3_head_trained_on_the_same_data(pipeline_result):
    """train.eagle3_baseline: an EAGLE-3 head on the same dataset, served autoregressively beside P-EAGLE."""
    result, _ = pipeline_result
    baseline = Path(result.head_dir).parent / "eagle3"
    assert json.loads((baseline / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    rows = [r for r in result.online.rows if r.method == "eagle-3"]
    assert [r.k for r in rows] == [3] and rows[0].num_draft_tokens > 0 and rows[0].acceptance_length > 1.0
    card = (Path(result.head_dir) / "README.md").read_text()
    assert "| K | P-EAGLE | EAGLE-3 |" in card  # the acceptance table has the baseline column
    eagle3_card = (baseline / "README.md").read_text()
    from peagle.export.card import TARGET_PLACEHOLDER, read_serve_line

    line = read_serve_line(eagle3_card)  # the embedded target has no hub id: `peagle pull --target` fills it
    assert (line.target_ref, line.parallel_drafting) == (TARGET_PLACEHOLDER, False)
    assert result.target_path not in eagle3_card and result.head_dir not in card
    assert "| K | EAGLE-3 | P-EAGLE |" in eagle3_card


def test_flow_tracks_and_registers_in_mlflow(pipeline_result):
    from mlflow import MlflowClient

    result, tmp_path = pipeline_result
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run(result.mlflow_run_id)
    assert run.data.params["train.k_train"] == "6"
    assert "seconds_train" in run.data.metrics
    children = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run.info.run_id}'")
    assert {c.info.run_name for c in children} >= {"target", "data", "train", "train-eagle3", "export", "evaluate",
                                                   "publish"}
    assert result.model_version == "1" and result.promotion.promoted  # first head: champion
    champion = client.get_model_version_by_alias("peagle-embedded", "champion")
    assert str(champion.version) == "1"


def test_trained_head_accepts_more_than_a_random_head(pipeline_result):
    from peagle.data.vocab import DraftVocab
    from peagle.eval.online import evaluate_online
    from peagle.export.head import export_head
    from peagle.facts import HeadSpec
    from peagle.model import PEagleDrafter
    from peagle.pipeline import load_eval_prompts
    from peagle.config import load_config

    result, tmp_path = pipeline_result
    cfg = load_config(REPO / "configs" / "demo.yaml", small_demo_overrides(tmp_path))
    data_dir = Path(result.data_dir)
    spec = HeadSpec.load(Path(result.checkpoint_dir) / "head_spec.json")  # the trained head's shape
    vocab = DraftVocab.load(data_dir / "vocab.safetensors")
    torch.manual_seed(0)
    random_head = export_head(PEagleDrafter(spec).state_dict(), spec, vocab, tmp_path / "random-head",
                              target_path=result.target_path)
    random = evaluate_online(result.target_path, {"random": random_head}, cfg.vllm, load_eval_prompts(cfg),
                             ks=[3], max_tokens=cfg.eval.max_tokens, include_baseline=False)
    trained = result.online.acceptance_by_k("p-eagle")[3]
    assert trained > random.acceptance_by_k("random")[3] + 0.2
