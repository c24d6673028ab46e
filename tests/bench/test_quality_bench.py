"""bench/quality.py's budget -> steps rule: a calibration run per recipe, or a given step time."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import quality  # noqa: E402


def test_step_seconds_are_parsed_per_method():
    assert quality.parse_step_seconds(["peagle=0.28", "eagle3=0.53"]) == {"peagle": 0.28, "eagle3": 0.53}
    assert quality.parse_step_seconds(None) == {}


@pytest.mark.parametrize("pair", ["medusa=0.3", "peagle", "peagle=0", "peagle=-1", "peagle=fast"])
def test_a_bad_step_seconds_pair_names_the_form(pair):
    with pytest.raises(ValueError, match="--step-seconds") as err:
        quality.parse_step_seconds([pair])
    assert "METHOD=SECONDS" in str(err.value) or "positive" in str(err.value)


def test_a_given_step_time_replaces_the_calibration(monkeypatch):
    def no_calibration(*args, **kwargs):
        raise AssertionError("a method with a given step time must not be calibrated")

    monkeypatch.setattr(quality, "calibrate", no_calibration)
    monkeypatch.setattr(quality.Bench, "target_revision", lambda self: "local:aaaa")
    bench = quality.Bench(str(ROOT / "configs" / "tiny.yaml"), {}, None, Path("data"), Path("work"), [1],
                          {"peagle": 0.25})
    assert bench.seconds_per_step("peagle", {}) == (0.25, "given")
    runs = [{"method": "peagle", "calibrated_step_s": 0.25, "step_s_source": "given"},
            {"method": "eagle3", "calibrated_step_s": 0.5, "step_s_source": "calibration"}]
    assert quality.given_step_note(runs) == (
        ", or by the seconds per step given with --step-seconds (peagle 0.25 s; their train s ran under "
        "whatever load there was)")
    assert quality.given_step_note(runs[1:]) == ""


def test_a_given_step_time_grows_with_the_answers_a_step_trains_on(monkeypatch):
    """--step-seconds is the config recipe's step: a variant of 4 answers a step gets a quarter of
    the steps in the same budget, not 4x the time."""
    monkeypatch.setattr(quality.Bench, "target_revision", lambda self: "local:aaaa")
    demo = str(ROOT / "configs" / "tiny.yaml")
    bench = quality.Bench(demo, {}, None, Path("data"), Path("work"), [1], {"peagle": 0.25})
    assert bench.seconds_per_step("peagle", {"train.recipe.batch_size": 4}) == (1.0, "given")
    assert bench.seconds_per_step("peagle", {"train.recipe.micro_batch_size": 2, "train.recipe.batch_size": 4}) == (1.0, "given")
    # Where the config itself accumulates, the given time is already its step's.
    accumulating = quality.Bench(demo, {"train.recipe.batch_size": 2}, None, Path("data"), Path("work"), [1], {"peagle": 0.5})
    assert accumulating.seconds_per_step("peagle", {}) == (0.5, "given")
    assert accumulating.seconds_per_step("peagle", {"train.recipe.batch_size": 4}) == (1.0, "given")


def test_the_command_refuses_a_bad_pair_before_training():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "quality.py"), "--step-seconds", "peagle=0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--step-seconds 'peagle=0': SECONDS must be a positive number" in proc.stderr


def _run(recipe: str, al5: float, target: str | None, seed: int = 0) -> dict:
    run = {"part": "variants", "recipe": recipe, "method": "peagle", "budget_s": 180.0, "seed": seed,
           "train": {"k_train": 5, "eagle3_ttt_steps": 5, "lr": 1.5e-3, "layers": 3, "optimizer": "muon",
                     "muon_lr": 0.02},
           "acceptance_length": {"5": al5}, "per_position": [0.9], "train_seconds": 180.0, "steps": 667,
           "offline_split": "served"}
    return run if target is None else {**run, "target_revision": target}


def _table_rows(add_table, runs: list[dict]) -> list[list]:
    """The rows one of the bench's tables (``add_variants_table``, ``add_data_table``) makes of ``runs``."""
    run = quality.Run.__new__(quality.Run)
    run.sections = []
    add_table(run, {"runs": runs}, ["5"])
    return run.sections[0]["rows"]


def _variants_rows(runs: list[dict]) -> list[list]:
    return _table_rows(quality.add_variants_table, runs)


def test_runs_of_different_target_builds_are_never_averaged_or_compared():
    # The same recipe measured on two machines' builds of the embedded target, and a variant on one.
    runs = [_run("config recipe", 4.8, "local:aaaa"), _run("config recipe", 4.3, "local:bbbb"),
            _run("3 KV heads (one per query head)", 4.9, "local:aaaa")]
    rows = {r[0]: r for r in _variants_rows(runs)}
    assert set(rows) == {"config recipe [target local:aaaa]", "config recipe [target local:bbbb]",
                         "3 KV heads (one per query head) [target local:aaaa]"}
    assert rows["config recipe [target local:aaaa]"][6] == "4.800"  # not the 4.55 of both builds
    assert rows["3 KV heads (one per query head) [target local:aaaa]"][7] == "+0.100"  # against its own build's


def test_one_target_build_keeps_the_tables_as_they_were():
    rows = _variants_rows([_run("config recipe", 4.8, "local:aaaa", seed=0), _run("config recipe", 4.6, "local:aaaa", seed=1)])
    assert [r[0] for r in rows] == ["config recipe"] and rows[0][5] == 2 and rows[0][6] == "4.700"
    assert quality.setting(_run("config recipe", 4.8, None)).target == quality.UNRECORDED_TARGET


def test_a_run_replaces_only_the_same_run_on_the_same_target_build():
    old = [_run("config recipe", 4.8, None), _run("config recipe", 4.6, "local:aaaa")]
    new = [_run("config recipe", 4.3, "local:aaaa")]
    assert [r["acceptance_length"]["5"] for r in quality.merged(old, new)] == [4.8, 4.3]


def test_a_variant_without_its_own_config_run_compares_with_the_budgets_part():
    # The budgets part trained the config recipe at this budget; the variants part did not.
    config = {**_run("config recipe", 4.6, "local:aaaa"), "part": "budgets"}
    other_build = {**_run("config recipe", 4.0, "local:bbbb"), "part": "budgets"}
    rows = {r[0]: r for r in _variants_rows([config, other_build, _run("lm_head trains", 4.7, "local:aaaa")])}
    assert rows["lm_head trains [target local:aaaa]"][7] == "+0.100"
    assert not any(label.startswith("config recipe") for label in rows)  # budgets runs keep their own table


def test_runs_on_two_datasets_of_one_target_build_are_kept_apart():
    # The config recipe on the whole 288-answer train split (a variants run), and the data part on a
    # grown dataset of the same target build: its first 288 answers and all 1,000.
    def on(data: str, al5: float, part: str = "data", answers: int | None = None, seed: int = 0) -> dict:
        run = {**_run("config recipe" if part == "variants" else f"first {answers} answers", al5, "local:aaaa", seed),
               "part": part, "data_build": data, "steps": 404, "train_answers": 288 if data == "small" else 1000}
        return run if answers is None else {**run, "overrides": {"train.recipe.max_samples": answers}}

    rows = _table_rows(quality.add_data_table, [on("small", 1.38, "variants"), on("small", 1.40, "variants", seed=1),
                       on("grown", 1.36, answers=288), on("grown", 1.45, answers=1000)])
    assert [(r[0], r[3], r[5]) for r in rows] == [
        ("288 [target local:aaaa, data grown]", 1, "1.360"), ("1000 [target local:aaaa, data grown]", 1, "1.450"),
        ("288 [target local:aaaa, data small]", 2, "1.390")]
    assert quality.setting(on("small", 1.38)) != quality.setting(on("grown", 1.38))
    assert quality.setting(_run("config recipe", 4.8, "local:aaaa")).target == "local:aaaa"  # no dataset recorded


def test_two_invocations_writing_one_result_file_keep_each_others_runs(tmp_path, monkeypatch):
    import result_files

    monkeypatch.setattr(result_files, "RESULTS_DIR", tmp_path)
    meta = {"data_dir": "data", "ks": [5], "base_overrides": {}}
    first, second = (quality.Results(quality.Run("quality", {"config": "c.yaml", "threads": 1}), False, dict(meta))
                     for _ in range(2))  # both started before either wrote, as two processes are
    first.add(_run("config recipe", 4.6, "local:aaaa"))
    second.add(_run("3 KV heads (one per query head)", 4.8, "local:aaaa"))
    first.add(_run("config recipe", 4.5, "local:aaaa", seed=1))
    saved = quality.Run.restore("quality").meta["runs"]
    assert sorted((r["recipe"], r["seed"]) for r in saved) == [
        ("3 KV heads (one per query head)", 0), ("config recipe", 0), ("config recipe", 1)]


def _with_weight(run: dict, weight: float) -> dict:
    return {**run, "train": {**run["train"], "unaccepted_weight": weight}}


def test_a_variant_compares_with_the_config_recipe_of_its_own_off_chain_weight():
    # Config recipes of two invocations at the same steps: every element charged (1.0), and the config's (0).
    before = _with_weight({**_run("config recipe", 4.6, "local:aaaa"), "part": "budgets"}, 1.0)
    now = _with_weight({**_run("config recipe", 4.9, "local:aaaa"), "part": "budgets"}, 0.0)
    share = _with_weight(_run("depth 0 at its uniform share", 5.0, "local:aaaa"), 0.0)
    weight = _with_weight(_run("every draft's loss counts, read by verification or not", 5.2, "local:aaaa"), 1.0)
    rows = {r[0].split(" [")[0]: r for r in _variants_rows([before, now, share, weight])}
    assert rows["depth 0 at its uniform share"][7] == "+0.100"  # against the recipe it changed (x0)
    # the change of weight: against the config recipe of the other weight
    assert rows["every draft's loss counts, read by verification or not"][7] == "+0.300"


def test_saved_heads_are_the_budget_and_seed_asked_for_with_their_checkpoints(tmp_path):
    here, gone = tmp_path / "here", tmp_path / "gone"
    here.mkdir()
    runs = [{"part": "budgets", "budget_s": 360.0, "seed": 0, "method": "peagle", "checkpoint": str(here)},
            {"part": "budgets", "budget_s": 360.0, "seed": 0, "method": "eagle3", "checkpoint": str(gone)},
            {"part": "budgets", "budget_s": 180.0, "seed": 0, "method": "eagle3", "checkpoint": str(here)},
            {"part": "variants", "budget_s": 360.0, "seed": 0, "method": "peagle", "checkpoint": str(here)}]
    assert quality.saved_heads(runs, 360.0, 0) == runs[:1]
    with pytest.raises(SystemExit, match="no saved budgets run at 360 s, seed 1"):
        quality.saved_heads(runs, 360.0, 1)


def test_clock_and_step_seconds_are_refused_together():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "quality.py"), "--clock", "--step-seconds", "peagle=0.3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--clock trains each budget by the clock; --step-seconds turns budgets into steps" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)  # bench/quality.py --quick's budgets part: two torchrun trainings and their evaluation
def test_clock_trains_each_budget_on_the_pipelines_clock(tmp_path):
    """--clock: no calibration, train.recipe.max_train_seconds = the budget (--quick's 3 s), and the
    result says so."""
    env = {**os.environ, "PEAGLE_BENCH_RESULTS": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "quality.py"), "--quick", "--clock", "--part", "budgets",
                           "--methods", "peagle"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    meta = json.loads((tmp_path / "quality.json").read_text())["meta"]
    [run] = meta["runs"]
    assert (run["step_s_source"], run["calibrated_step_s"], run["budget_s"]) == ("clock", None, 3.0)
    # the clock stops at the step that ends nearest the budget (tiny steps: tens of ms)
    assert abs(run["train_seconds"] - 3.0) < 1.0 and run["steps"] > 2
    assert "1 run(s) by --clock: train.recipe.max_train_seconds = the budget" in (tmp_path / "quality.md").read_text()


def _budget_run(budget: float, al5: float, ngram: float = 1.5) -> dict:
    return {**_run("config recipe", al5, "local:aaaa"), "part": "budgets", "budget_s": budget,
            "train_seconds": budget, "calibrated_step_s": 1.0, "ngram_acceptance_length": {"5": ngram}}


def _projection_rows(runs: list[dict]) -> list[list]:
    run = quality.Run.__new__(quality.Run)
    run.sections = []
    quality.add_projection_table(run, {"runs": runs}, ["5"])
    return run.sections[0]["rows"] if run.sections else []


def test_the_projection_reads_the_time_to_reach_n_gram_lookup_and_the_goal_off_a_log_time_line():
    # +0.1 acceptance per doubling from 1.2 at 100 s: n-gram lookup's 1.5 at 800 s, the goal's 2.5 at 2^13 x 100 s.
    rows = _projection_rows([_budget_run(100, 1.2), _budget_run(200, 1.3), _budget_run(400, 1.4)])
    assert len(rows) == 1
    method, _, budgets, per_doubling, residual, ngram, to_ngram, goal, to_goal = rows[0]
    assert (method, budgets, per_doubling, residual, ngram, goal) == ("peagle", "100 200 400", "+0.100", "0.000",
                                                                      "1.50", "2.50")
    assert to_ngram == "0.22 h (800 steps)"
    assert to_goal == "230 h (819,200 steps)"


@pytest.mark.parametrize("seconds, text", [(792, "0.22 h"), (12_600, "3.5 h"), (4.68e6, "1,300 h"), (36_000, "10 h")])
def test_hours_keep_two_significant_digits_without_an_exponent(seconds, text):
    assert quality.hours(seconds) == text


def test_no_projection_from_fewer_than_three_budgets_and_none_reached_by_a_falling_line():
    assert _projection_rows([_budget_run(100, 1.2), _budget_run(400, 1.4)]) == []
    rows = _projection_rows([_budget_run(100, 1.4), _budget_run(200, 1.3), _budget_run(400, 1.2)])
    assert rows[0][6] == "never" and rows[0][8] == "never"


def test_the_copying_table_never_averages_two_recipes_run_under_one_label():
    versus = {"ngram_right": [0.3], "head_right_where_ngram_right": [0.1], "head_right_where_ngram_wrong": [0.4]}
    muon = {**_budget_run(400, 1.4), "versus_ngram": versus}
    adamw = {**_budget_run(400, 1.3), "versus_ngram": versus, "train": {**muon["train"], "optimizer": "adamw"}}
    run = quality.Run.__new__(quality.Run)
    run.sections = []
    quality.add_copying_table(run, {"runs": [muon, adamw]})
    rows = run.sections[0]["rows"]
    assert sorted((r[1], r[7]) for r in rows) == [
        ("config recipe (K_train 5, lr 0.0015, 3 layers)", "1.30"),
        ("config recipe (K_train 5, lr 0.0015, Muon 0.02, 3 layers)", "1.40"),
    ]
