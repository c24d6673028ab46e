"""Data health: the target's answers measured for diversity, loops, cut-offs and copying."""

import json

import pytest

from peagle.data.health import (
    Answer,
    DataHealthError,
    NgramLookup,
    check_health,
    measure_health,
    opening_of,
    simulated_lookup_acceptance,
)

PROMPT = list(range(100, 120))


def answer(tokens: list[int], text: str, finish: str = "stop") -> Answer:
    return Answer(PROMPT + tokens, [False] * len(PROMPT) + [True] * len(tokens), opening_of(text), [finish])


def test_lookup_drafts_what_followed_the_latest_earlier_match_and_never_the_future():
    assert NgramLookup([1, 2, 3, 4, 1, 2]).draft(6) == [3, 4, 1, 2]  # cut where the context ends
    assert NgramLookup([1, 2, 3, 1, 2, 3, 9, 1, 2]).draft(9) == [3, 9, 1, 2]  # the latest match
    assert NgramLookup([5, 6, 7, 8, 9]).draft(5) == []  # nothing recurs
    assert NgramLookup([1, 2, 3, 4, 5, 0, 1, 2, 3, 4]).draft(10, k=3) == [5, 0, 1]  # longest suffix first


def test_a_loop_is_all_accepted_and_fresh_text_is_not():
    loop = [7, 8, 9, 10] * 30
    produced, steps = simulated_lookup_acceptance(PROMPT + loop, [False] * 20 + [True] * 120)
    assert produced == 120 and produced / steps > 4.0
    fresh = list(range(1000, 1120))
    assert simulated_lookup_acceptance(PROMPT + fresh, [False] * 20 + [True] * 120) == (120, 120)


def test_looping_answers_that_open_alike_are_flagged_with_their_causes():
    loops = [answer([1, 2, 3, 4, 5, 6, 7, 8, 9] * 12, "def _path(self, key):\n    return self.path.path", "length")
             for _ in range(10)]
    report = measure_health(loops)
    assert report.answers == 10 and report.distinct_openings == 0.0
    assert report.repeated_token_share > 0.8 and report.length_share == 1.0 and report.ngram_acceptance > 3.5
    text = " ".join(report.warnings)
    for cause in ("ignore its prompt", "wrong chat template", "the target loops", "data.regenerate.max_tokens",
                  "n-gram lookup alone would accept"):
        assert cause in text
    assert report.top_openings == [("def _path(self, key):", 10)]
    check_health(report, strict=False)  # warns only
    with pytest.raises(DataHealthError, match="data.strict_health.*the target loops.*strict_health: false"):
        check_health(report, strict=True)


def test_an_opening_is_the_first_line_of_content_not_a_code_fence():
    assert opening_of("```python\ndef add(a, b):\n    return a + b\n```") == "def add(a, b):"
    assert opening_of("\n\n  Sure! Here is how.\nMore.") == "Sure! Here is how."


def test_diverse_answers_are_healthy():
    answers = [answer(list(range(1000 + 50 * i, 1040 + 50 * i)), f"Answer number {i}.") for i in range(10)]
    report = measure_health(answers)
    assert report.healthy and report.distinct_openings == 1.0 and report.repeated_token_share == 0.0
    assert report.ngram_acceptance == 1.0 and report.length_share == 0.0
    check_health(report, strict=True)
    assert json.loads(json.dumps(report.to_dict()))["healthy"] is True


@pytest.mark.slow
def test_the_tiny_test_targets_answers_are_flagged(pipeline_run):
    """The tiny built-from-scratch target ignores its prompt and loops: the data stage says so."""
    from peagle.config import load_config
    from peagle.layout import RunLayout

    cfg = load_config(pipeline_run.config, pipeline_run.overrides)
    report = json.loads(RunLayout(cfg.run_dir).data.health.read_text())
    assert not report["healthy"] and report["answers"] > 0
    assert report["distinct_openings"] < 0.5, report
    assert any("ignore its prompt" in w for w in report["warnings"])
