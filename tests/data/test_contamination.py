"""Evaluation prompts that are also training prompts are refused before any engine starts."""

import pytest

from peagle.config import ConfigError, load_config
from peagle.data.contamination import check_no_overlap, request_key
from peagle.data.prompt_sets import check_eval_prompts
from peagle.data.prompts import load_prompts
from peagle.paths import REPO_ROOT

TINY = REPO_ROOT / "configs" / "tiny.yaml"


def test_requests_compare_by_their_words_not_their_spacing_or_case():
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "  Write a\n haiku "}]
    assert request_key(chat) == request_key([{"role": "user", "content": "write a haiku"}]) == "write a haiku"
    assert request_key([{"role": "prompt", "content": "def f():\n"}, {"role": "completion", "content": "x"}]) \
        == request_key("def f():") == "def f():"


def test_the_shipped_sets_do_not_overlap_their_training_prompts():
    cfg = load_config(TINY, {"eval.prompts": ["humaneval", "chat", "data/prompts/code_eval.jsonl"]})
    training = [c.messages for c in load_prompts(cfg.data)]
    check_no_overlap(training, check_eval_prompts(cfg))


def test_training_prompts_as_an_eval_set_are_refused_naming_the_set():
    cfg = load_config(TINY, {"eval.prompts": ["chat", "data/prompts/code_train.jsonl"], "eval.num_prompts": 5,
                             "data.max_samples": None})  # every prompt of the file is trained on
    training = [c.messages for c in load_prompts(cfg.data)]
    with pytest.raises(ConfigError, match=r"5 of 5 prompts of eval set 'code_train' \(first: 'complete this python "
                                          r"function.*drop them from data.sources"):
        check_no_overlap(training, check_eval_prompts(cfg))

