"""The training benchmarks run end to end (--quick) and write well-formed result files.

Timings are not checked (project rule: tests check correctness, benchmarks measure);
each script imports torch + transformers in fresh processes, so this is marked slow.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = {
    "attention_memory": 11,  # 2 lengths: dense and flex forward, dense forward+backward
    "train_seqlen_memory": 8,  # 2 lengths x 2 segment counts, 8 columns
    "train_dataloading": 6,
    "train_forward_latency": 6,
    "train_loss_weighting": 6,  # weighting, seed, K=1..3 (quick K_train 3), train s
    "quality": 11,  # method, budget, trained as, train s, steps, seeds, K=1..3, per position, offline split
    "train_throughput": 10,  # trainer, trainable, elements, ms/step, 4 phases, tokens/s, vs the peer
    "gpu_smoke": 8,  # backend, tokens, S, tokens/s, step s, 2 peaks, status (its CPU smoke: dense, fp32)
}


PEER_MISSING = pytest.mark.skipif(importlib.util.find_spec("speculators") is None,
                                  reason="train_throughput times the peer trainer: `make bench-install` installs it")


@pytest.mark.slow
@pytest.mark.timeout(900)  # a whole benchmark script in a process of its own, up to its 600 s limit below
@pytest.mark.parametrize("name", [pytest.param(n, marks=PEER_MISSING) if n == "train_throughput" else n
                                  for n in sorted(SCRIPTS)])
def test_bench_quick_writes_results(name, tmp_path):
    env = {**os.environ, "PEAGLE_BENCH_RESULTS": str(tmp_path), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / f"{name}.py"), "--quick"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / f"{name}.json").read_text())
    assert result["meta"]["load_average_start"] and result["meta"]["load_average_end"]
    table = result["tables"][0]
    assert len(table["columns"]) == SCRIPTS[name]
    assert table["rows"] and all(len(r) == SCRIPTS[name] for r in table["rows"])
    assert (tmp_path / f"{name}.md").read_text().startswith(f"# {name}")
    if name == "attention_memory":  # every quick cell runs: both backends, their ratios, the training step
        assert all(isinstance(v, float) for r in table["rows"] for v in r[2:10]), table["rows"]
        assert [r[0] for r in result["tables"][1]["rows"]] == [256, 512]
    if name == "gpu_smoke":  # every CPU smoke cell trains one optimizer step; drafting has both Ks
        assert [(r[0], r[1], r[2], r[7]) for r in table["rows"]] == [
            ("dense", n, s, "ok") for n in (256, 512) for s in (1, 2)], table["rows"]
        assert [r[2] for r in result["tables"][1]["rows"]] == [1, 4, 1, 4]
    if name == "train_seqlen_memory":  # every quick cell fits: S=1 is the ratio's reference
        assert all(r[4] != "-" for r in table["rows"]), table["rows"]
        assert [r[5] for r in table["rows"] if r[1] == 1] == [1.0, 1.0]
    if name == "quality":  # both methods at the quick budget, the ablation's first and last recipe, one variant
        assert sorted(r[0] for r in table["rows"]) == ["eagle3", "peagle"]
        # the drafter takes the tiny target's attention shape (4 query heads sharing 2 KV heads)
        # and no loss on drafts greedy verification never reads (train.recipe.unaccepted_weight 0)
        assert {r[0]: r[2] for r in table["rows"]} == {
            "peagle": "K_train 3, lr 0.003, Muon 0.02, 1 layer, 4q/2kv heads, off-chain loss x0",
            "eagle3": "TTT 3, lr 0.003, Muon 0.02, 1 layer, 4q/2kv heads, off-chain loss x0"}
        assert "partial" not in result["meta"]  # rewritten after every run, finished at the end
        # every run names the target build and CPU it measured (machines build the embedded target differently)
        assert all(r["target_revision"].startswith("local:") and r["cpu"] for r in result["meta"]["runs"])
        # "train s" as the pipeline's clock counts: the first step (Muon's compilation) is not in it
        assert all(0 < r["train_seconds"] < r["wall_seconds"] and r["first_step_seconds"] > 0
                   for r in result["meta"]["runs"] if "first_step_seconds" in r)
        assert sum("first_step_seconds" in r for r in result["meta"]["runs"]) >= 4
        ablation = result["tables"][1]["rows"]
        assert [r[1] for r in ablation] == ["peagle", "peagle", "eagle3"]
        variants = result["tables"][2]["rows"]
        staged = "staged: EAGLE-3 for half the budget, then P-EAGLE from its head"
        oracle = "mask slots given the true previous token (upper bound)"
        assert [r[0] for r in variants] == ["config recipe", oracle, staged]
        # the recipe as trained: the variant's change in it
        assert variants[1][2] == ("K_train 3, lr 0.003, Muon 0.02, 1 layer, 4q/2kv heads, off-chain loss x0, "
                                  "true previous tokens in the mask slots")
        # the data part: the first 4 answers for the budget's steps, beside the whole split's 12 (the
        # config recipe's run of the same steps: --quick calibrates each method once, for every recipe)
        data = result["tables"][3]
        assert data["title"].startswith("Data size") and [r[0] for r in data["rows"]] == [4, 12]
        assert len({r[1] for r in data["rows"]}) == 1  # the same steps
        # every run is walked beside vLLM's n-gram lookup on the same tokens
        copying = result["tables"][4]
        assert copying["title"].startswith("Copying") and len(copying["rows"]) >= 5
        assert all(float(r[6]) >= 1.0 and len(r[8].split()) == 3 for r in copying["rows"])
        recipe_k3, variant_k3, delta = float(variants[0][8]), float(variants[1][8]), variants[1][9]
        # three roundings to 3 places
        assert variants[0][9] == "" and float(delta) == pytest.approx(variant_k3 - recipe_k3, abs=2e-3)
        assert all(1.0 <= float(v) <= 4.0 for r in table["rows"] + variants for v in r[6:9])
        assert all(1.0 <= float(v) <= 4.0 for r in ablation for v in r[5:8])
        # every run is an MLflow run: its step metrics streamed, its numbers and row logged
        from mlflow import MlflowClient

        client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
        for row in result["meta"]["runs"]:
            tracked = client.get_run(row["mlflow_run_id"])
            assert tracked.info.status == "FINISHED" and tracked.data.params["method"] == row["method"]
            assert tracked.data.metrics["acceptance_length_k1"] == pytest.approx(row["acceptance_length"]["1"])
            assert len(client.get_metric_history(row["mlflow_run_id"], "loss")) == row["steps"]
        # a row whose config an earlier row trained (the budgets part's two heads: the variants'
        # config recipe and the ablation's EAGLE-3 at the same budget) shares that row's run
        runs = result["meta"]["runs"]
        trained = {r["mlflow_run_id"] for r in runs if "same_training_as" not in r}
        shared = [r for r in runs if "same_training_as" in r]
        assert shared and all(r["mlflow_run_id"] in trained for r in shared), [r.get("same_training_as") for r in runs]
        assert len(trained) + len(shared) == len(runs)
        # the staged run: an EAGLE-3 head for half the budget, then P-EAGLE warm started from it
        run = next(r for r in result["meta"]["runs"] if r["recipe"] == staged)
        assert run["method"] == "peagle" and run["overrides"] == {"staged_eagle3_share": 0.5}
        first = run["stage1_eagle3"]
        assert first["steps"] >= 2 and "/eagle3/" in first["checkpoint"]
        assert run["train_seconds"] > first["train_seconds"]
        assert run["warm_start"]["kept_fresh"] == ["mask_hidden"]  # the EAGLE-3 head seeded the rest
        assert (tmp_path / "quality.png").stat().st_size > 0
    if name == "train_loss_weighting":  # one quick run per weighting (tiny random target), then their delta
        assert [r[0] for r in table["rows"]] == ["uniform", "per_depth_mean", "per_depth_mean - uniform"]
        assert all(1.0 <= float(v) <= 4.0 for r in table["rows"][:2] for v in r[2:5])
        assert [r["weighting"] for r in result["meta"]["runs"]] == ["uniform", "per_depth_mean"]
    if name == "train_throughput":  # ours and the peer's step on the same samples, shapes and COD settings
        assert [r[0] for r in table["rows"]] == ["peagle", "speculators"]
        ours, peer = table["rows"]
        assert float(ours[1]) > 0 and float(peer[1]) > 0
        # the same depths, ratio and floor over the same samples: about as many elements per step
        assert 0.8 < int(ours[2]) / int(peer[2]) < 1.25, table["rows"]
        assert peer[-1] == "1.00x"
        ratio = float(peer[3]) / float(ours[3])  # ms/step: the speed column is their ratio
        assert float(ours[-1].rstrip("x")) == pytest.approx(ratio, rel=0.05)
