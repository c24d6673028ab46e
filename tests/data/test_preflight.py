"""The data stage's checks before an engine starts (``peagle.data.preflight``), which `peagle
config check` runs too: what is left for later (magpie files, hub sets not read), and what
each refusal names."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the data tests' builders (--import-mode=importlib)
from test_pipeline import CONVERSATIONS, make_cfg  # noqa: E402

from peagle.config import ConfigError, parse_config  # noqa: E402
from peagle.data.preflight import check_data_inputs, check_writable  # noqa: E402
from peagle.data.synthesize import write_requests  # noqa: E402


@pytest.fixture
def prompts_path(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    return path


def with_sources(cfg, *sources: dict, **data):
    raw = cfg.model_dump(mode="json", by_alias=True)
    raw["data"].update({"sources": [s for s in sources], **data})
    return parse_config(raw)


def test_a_magpie_file_is_read_once_the_target_has_written_it(tmp_path, prompts_path, make_tokenizer, templates):
    tok = make_tokenizer(templates["plain"])
    magpie = tmp_path / "magpie.jsonl"
    cfg = with_sources(make_cfg(tmp_path, prompts_path), {"kind": "jsonl", "path": str(prompts_path)},
                       {"kind": "magpie", "path": str(magpie), "max_samples": 3}, heldout_samples=14)
    before = check_data_inputs(cfg, tok, 6, download=False)
    assert [s.path for s in before.unwritten] == [str(magpie)] and len(before.prompts) == len(CONVERSATIONS)
    assert before.notes() == [f"magpie:{magpie}: written by the target in the data stage (3 requests)"]
    write_requests(magpie, ["Sort a list of names.", "Parse a date string.", "Count the vowels."], cfg.target.model)
    after = check_data_inputs(cfg, tok, 6)
    assert not after.unwritten and len(after.prompts) == len(CONVERSATIONS) + 3
    write_requests(magpie, ["Sort a list of names.", "Parse a date string.", "Count the vowels."], "another/target")
    assert check_data_inputs(cfg, tok, 6).unwritten  # another target's requests are written again
    with pytest.raises(ConfigError, match=r"data.heldout_samples=15 leaves no training samples out of 15 prompts"):
        check_data_inputs(cfg.model_copy(update={"data": cfg.data.model_copy(update={"heldout_samples": 15})}),
                          tok, 6, download=False)


def test_a_hub_set_is_read_only_from_the_cache_and_only_with_the_hub_off(tmp_path, prompts_path, monkeypatch):
    import datasets

    hub_set = {"kind": "hf", "path": "peagle-test/no-such-dataset", "split": "train"}
    cfg = with_sources(make_cfg(tmp_path, prompts_path), {"kind": "jsonl", "path": str(prompts_path)}, hub_set,
                       heldout_samples=100)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    inputs = check_data_inputs(cfg, download=False)  # config check: the hub is on, nothing is downloaded
    assert [s.path for s in inputs.unread] == ["peagle-test/no-such-dataset"]
    assert "downloaded by the data stage; not read here" in inputs.notes()[0]  # counts unknown: not refused
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match=r"data.sources\[1\] \(hf:peagle-test/no-such-dataset:train\): cannot load "
                                          r"dataset .* not in the local cache"):
        check_data_inputs(cfg, download=False)


def test_the_mask_token_is_counted_in_the_prompts_scanned(tmp_path, prompts_path, make_tokenizer, templates):
    tok = make_tokenizer(templates["plain"])
    cfg = make_cfg(tmp_path, prompts_path)
    square = tok("Print", add_special_tokens=False)["input_ids"][0]  # 9 of the 12 prompts ask to print
    with pytest.raises(ConfigError, match=r"occurs \d+ times in \d+ of 12 prompts of data.sources"):
        check_data_inputs(cfg, tok, square)
    with pytest.raises(ConfigError, match=r"occurs \d+ times? in \d+ of 5 prompts of data.sources"):
        check_data_inputs(cfg, tok, square, scan=5)


def test_a_directory_that_takes_no_file_is_refused(tmp_path):
    check_writable(tmp_path / "new" / "run", "workdir")  # made when missing: its parent takes a file
    assert not (tmp_path / "new").exists()
    with pytest.raises(ConfigError, match=r"workdir: /proc/peagle-run cannot be written \(/proc: .*\): set workdir"):
        check_writable(Path("/proc/peagle-run"), "workdir")


def test_a_benchmark_is_left_to_the_run(tmp_path, prompts_path):
    cfg = make_cfg(tmp_path, prompts_path)
    cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"prompts": ["data/prompts/code_eval.jsonl",
                                                                                  "mt-bench"]})})
    inputs = check_data_inputs(cfg, download=False)
    assert list(inputs.eval_sets) == ["code_eval"]
    assert inputs.notes() == ["eval set 'mt-bench': a benchmark the run downloads; not read here"]
