"""The serving-speed benchmark's summary: ratios are taken within a round, then summarised."""


import pytest

from tests.support.bench import load_bench


def test_ratios_pair_measurements_of_the_same_round_and_name_the_fastest_k():
    bench = load_bench("serving_speed")
    c = bench.cell
    # a fast round and a slow one: no speculation, n-gram lookup and P-EAGLE at K 3 and 5, concurrency 1 and 4
    rounds = [{c("baseline", 0, 1): 100.0, c("baseline", 0, 4): 300.0,
               c("ngram", 3, 1): 110.0, c("ngram", 5, 1): 100.0, c("ngram", 3, 4): 300.0, c("ngram", 5, 4): 240.0,
               c("p-eagle", 3, 1): 150.0, c("p-eagle", 5, 1): 120.0, c("p-eagle", 3, 4): 330.0,
               c("p-eagle", 5, 4): 360.0},
              {c("baseline", 0, 1): 50.0, c("baseline", 0, 4): 150.0,
               c("ngram", 3, 1): 50.0, c("ngram", 5, 1): 45.0, c("ngram", 3, 4): 150.0, c("ngram", 5, 4): 150.0,
               c("p-eagle", 3, 1): 70.0, c("p-eagle", 5, 1): 70.0, c("p-eagle", 3, 4): 150.0,
               c("p-eagle", 5, 4): 180.0}]
    methods, ks, conc = ["ngram", "p-eagle"], [3, 5], [1, 4]
    over = bench.ratio_grid(rounds, methods, ks, conc, "baseline", "baseline")
    assert over[c("p-eagle", 3, 1)] == pytest.approx({"median": 1.45, "min": 1.4, "max": 1.5})
    assert over[c("ngram", 5, 4)] == pytest.approx({"median": 0.9, "min": 0.8, "max": 1.0})
    over_ngram = bench.ratio_grid(rounds, methods, ks, conc, "ngram", "baseline")
    assert set(over_ngram) == {c("p-eagle", k, cc) for k in ks for cc in conc}  # at the same K
    assert over_ngram[c("p-eagle", 5, 1)] == pytest.approx({"median": (1.2 + 70 / 45) / 2, "min": 1.2,
                                                            "max": 70 / 45})
    best = bench.fastest_k(over, methods, ks, conc)
    assert best["p-eagle"] == {1: (3, pytest.approx(1.45)), 4: (5, pytest.approx(1.2))}
    assert best["ngram"][1] == (3, pytest.approx(1.05))
    meta = {"date": "d", "ks": ks, "concurrency": conc, "prompts": "humaneval", "methods": methods,
            "baseline": "baseline", "num_prompts": 8, "max_tokens": 96, "load_average": [0.1]}
    per_step = {"ngram": {"3": "1.35-1.40 (2.50)"}, "p-eagle": {"3": "1.40 (1.40)", "5": "1.41 (1.41)"}}
    text = bench.markdown(rounds, per_step, {"baseline": over, "ngram": over_ngram}, best, meta)
    assert "| 1 | 3 | 1.05x (1.00-1.10) | 1.45x (1.40-1.50) |" in text
    assert "| p-eagle | K=3 (1.45x) | K=5 (1.20x) |" in text
    assert "Tokens per target step at concurrency 1 (last round), vLLM's acceptance length in brackets" in text
    assert "| ngram | 1.35-1.40 (2.50) | - |" in text and bench.PER_STEP_NOTE in text


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


def test_the_k_grid_stops_at_the_k_the_heads_were_trained_for():
    bench = load_bench("serving_speed")
    assert bench.grid_ks(7) == [3, 5, 7]
    assert bench.grid_ks(5) == [3, 5]
    assert bench.grid_ks(3) == [3]
    assert bench.grid_ks(2) == [2]  # below the grid: the heads' own K
