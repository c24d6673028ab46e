"""A GPU config's training priced in GPU hours from the trainer's throughput measured on a GPU."""

import json
import re
from pathlib import Path

import pytest

from peagle.config import load_config
from peagle.facts import TargetFacts, default_aux_layer_ids
from peagle.train.gpu_hours import MEASURED, gpu_hours_line

REPO = Path(__file__).resolve().parents[2]
TRAIN_TOKENS = (200_000 - 512) * 8192  # the GPU recipe's train split, every sample at max_seq_len

# The targets' own config.json values (hub snapshots): what the plan reads through TargetFacts.
TARGET_SHAPES = {
    "llama-3.1-8b-instruct": dict(target_num_layers=32, target_hidden_size=4096, vocab_size=128256,
                                  target_num_heads=32, target_num_kv_heads=8, target_head_dim=128,
                                  target_intermediate_size=14336, max_position_embeddings=131072),
    "qwen3-8b": dict(target_num_layers=36, target_hidden_size=4096, vocab_size=151936, target_num_heads=32,
                     target_num_kv_heads=8, target_head_dim=128, target_intermediate_size=12288,
                     max_position_embeddings=40960),
    "gpt-oss-20b": dict(target_num_layers=24, target_hidden_size=2880, vocab_size=201088, target_num_heads=64,
                        target_num_kv_heads=8, target_head_dim=64, target_intermediate_size=2880,
                        max_position_embeddings=131072),
}


def facts(name: str, draft_vocab: int = 32000) -> TargetFacts:
    shape = TARGET_SHAPES[name]
    return TargetFacts(target=name, target_revision=None, rms_norm_eps=1e-5, rope_theta=1e6, rope_scaling=None,
                       aux_layer_ids=default_aux_layer_ids(shape["target_num_layers"]),
                       final_layer_id=shape["target_num_layers"], mask_token_id=1, draft_vocab_size=draft_vocab,
                       **shape)


def gpu_config(name: str, **overrides):
    return load_config(REPO / "configs" / f"{name}.yaml", overrides)


def test_llama_at_the_measured_shape_is_epochs_times_tokens_over_the_measured_rate():
    line = gpu_hours_line(gpu_config("llama-3.1-8b-instruct"), facts("llama-3.1-8b-instruct"), TRAIN_TOKENS)
    hours = 20 * TRAIN_TOKENS / 7487 / 3600
    assert f"at most {hours:,.0f} H200 GPU hours" in line and "at 7,487 tokens/s a GPU, measured" in line, line
    assert f"{hours / 8:,.0f} hours on train.launch.world_size 8 GPUs if the ranks scale linearly" in line, line


def test_a_narrower_drafter_is_projected_by_its_matrix_parameters_and_says_so():
    line = gpu_hours_line(gpu_config("gpt-oss-20b"), facts("gpt-oss-20b"), TRAIN_TOKENS)
    assert "projected from the 7,487 measured at Llama-3.1-8B's shape by matrix parameters, 323M against 1,054M" in line
    rate = int(re.search(r"at ([\d,]+) tokens/s a GPU", line).group(1).replace(",", ""))
    assert rate == pytest.approx(7487 * 1054 / 323, rel=0.01)


def header(path: Path) -> str:
    return " ".join(row.lstrip("#").strip() for row in path.read_text().splitlines() if row.startswith("#"))


@pytest.mark.parametrize("name", list(TARGET_SHAPES))
def test_each_gpu_config_header_quotes_its_plan(name):
    """Its training's GPU hours in its own header; its disk there, or in the base's for hidden size 4096."""
    from peagle.data.budget import DataBudget

    cfg, own = gpu_config(name), header(REPO / "configs" / f"{name}.yaml")
    line = gpu_hours_line(cfg, facts(name), TRAIN_TOKENS)
    for figure in re.findall(r"at most [\d,]+ H200 GPU hours|at [\d,]+ tokens/s|[\d,]+ hours on train.launch.world_size \d+",
                             line):
        assert figure in own, (figure, own)
    hidden = TARGET_SHAPES[name]["target_hidden_size"]
    disk = DataBudget(samples=cfg.data.max_samples, heldout=cfg.data.heldout_samples, max_tokens=cfg.data.max_seq_len,
                      num_layers=4, hidden_size=hidden, storage_dtype="bfloat16", hidden_states="stored", spool_bytes=0,
                      free=0, where="/").lines()[2].split("): ", 1)[1]  # "49.3 TiB in bfloat16, 24.7 TiB in float8"
    quoted = own if hidden != 4096 else header(REPO / "configs" / "gpu" / "base.yaml")
    for figure in disk.split(", "):
        assert figure in quoted, (figure, quoted)


def test_a_step_unlike_the_measured_one_is_not_priced_and_says_what_was_measured():
    for overrides in ({"train.peagle.k_train": 10}, {"train.recipe.segments": 1}, {"train.launch.attention": "dense"},
                      {"train.recipe.max_len": 4096}):
        line = gpu_hours_line(gpu_config("llama-3.1-8b-instruct", **overrides), facts("llama-3.1-8b-instruct"),
                              TRAIN_TOKENS)
        assert line.startswith("training: GPU hours not estimated"), (overrides, line)
        assert "k_train 8, cod_ratio 0.8, max_len 8,192 in 2 segments, flex attention, optimizer adamw or muon" in line
    muon = gpu_hours_line(gpu_config("llama-3.1-8b-instruct", **{"train.recipe.optimizer": "muon"}),
                          facts("llama-3.1-8b-instruct"), TRAIN_TOKENS)
    assert "at 7,593 tokens/s a GPU, measured" in muon, muon


def test_a_time_budget_prices_itself():
    cfg = gpu_config("llama-3.1-8b-instruct", **{"train.recipe.max_train_seconds": 36000})
    line = gpu_hours_line(cfg, facts("llama-3.1-8b-instruct"), TRAIN_TOKENS)
    assert line == "training: 10.0 hours on 8 GPU(s) (train.recipe.max_train_seconds), 80 GPU hours"


def test_the_rates_are_the_ones_the_gpu_smoke_measured():
    """The plan's rates are copies of a result file's cells (8,192 tokens, 2 segments, flex): the
    file owns them, and a new measurement there must be carried here."""
    results = json.loads((REPO / "bench" / "results" / "h200" / "gpu_smoke_muon.json").read_text())
    muon = results["tables"][0]
    [adamw] = [table for table in results["tables"] if "with AdamW" in table["title"]]
    for table, optimizer in ((muon, "muon"), (adamw, "adamw")):
        [row] = [r for r in table["rows"] if r[:3] == ["flex", 8192, 2]]
        [rate] = [m for m in MEASURED if m.optimizer == optimizer]
        assert round(row[3]) == rate.tokens_per_s and rate.source == "bench/results/h200/gpu_smoke_muon.md"
