"""The serving-speed benchmark's summary: ratios are taken within a round, then summarised."""

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ratios_pair_measurements_of_the_same_round():
    bench = load_bench("serving_speed")
    rounds = [{"baseline": 100.0, "p-eagle": 300.0, "eagle-3": 200.0},   # a fast round
              {"baseline": 50.0, "p-eagle": 100.0, "eagle-3": 100.0},    # a slow one
              {"baseline": 80.0, "p-eagle": 200.0, "eagle-3": 125.0}]
    ratios = bench.summarise(rounds, "p-eagle", "eagle-3", "baseline")
    assert ratios["p-eagle/eagle-3"] == pytest.approx({"median": 1.5, "min": 1.0, "max": 1.6})
    assert ratios["p-eagle/baseline"] == pytest.approx({"median": 2.5, "min": 2.0, "max": 3.0})
    assert ratios["eagle-3/baseline"] == pytest.approx({"median": 2.0, "min": 1.5625, "max": 2.0})
    meta = {"date": "d", "k": 5, "concurrency": 1, "num_prompts": 16, "max_tokens": 128, "load_average": [0.1]}
    text = bench.markdown(rounds, {"p-eagle": 4.1, "eagle-3": 4.84}, ratios, meta)
    assert "| 2 | 50.0 | 100.0 | 100.0 |" in text and "| p-eagle/eagle-3 | 1.50x | 1.00x | 1.60x |" in text


def test_engine_core_placements_are_compared_within_rounds(monkeypatch):
    import os

    bench = load_bench("serving_speed")
    by_core = {"here": [{"baseline": 100.0, "p-eagle": 300.0}, {"baseline": 50.0, "p-eagle": 200.0}],
               "process": [{"baseline": 50.0, "p-eagle": 300.0}, {"baseline": 50.0, "p-eagle": 100.0}]}
    rows = bench.compare_engine_cores(by_core, {"here": [3.0, 4.0], "process": [18.0, 17.0]})
    assert rows == [["here", "3.5", "1.00x", "1.00x"], ["process", "17.5", "0.75x", "0.75x"]]
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with bench.engine_core_in("process"):
        assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    with bench.engine_core_in("here"):
        assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
