"""Prompt sources: schemas, field maps, mixing by weight, dedup, determinism, clear errors."""

import json

import pytest

from peagle.config import ConfigError, DataConfig
from peagle.data.prompts import load_prompts, mix_quotas, split_heldout


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def data_cfg(*sources, **kw):
    return DataConfig.model_validate({"sources": list(sources), **kw})


def user_texts(convs):
    return [c.messages[0]["content"] if c.messages[0]["role"] == "user" else c.messages[1]["content"] for c in convs]


@pytest.fixture
def three_schemas(tmp_path):
    """One source per schema, with their usual column names."""
    messages = write_jsonl(tmp_path / "chat.jsonl", [
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"m{i}"},
                      {"role": "assistant", "content": f"a{i}"}, {"role": "user", "content": f"m{i} again"},
                      {"role": "assistant", "content": f"b{i}"}]}
        for i in range(6)
    ])
    import datasets

    sharegpt = str(tmp_path / "share.parquet")
    datasets.Dataset.from_list([
        {"conversations": [{"from": "human", "value": f"s{i}"}, {"from": "gpt", "value": f"r{i}"}]} for i in range(5)
    ]).to_parquet(sharegpt)
    gsm = write_jsonl(tmp_path / "gsm.jsonl", [{"question": f"q{i}", "answer": f"{i}"} for i in range(4)])
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [
        {"instruction": "sum", "input": f"{i} {i}", "output": f"{2 * i}"} for i in range(3)
    ])
    return messages, sharegpt, gsm, alpaca


def test_every_schema_normalises_to_messages(three_schemas):
    messages, sharegpt, gsm, alpaca = three_schemas
    cfg = data_cfg(
        {"kind": "jsonl", "path": messages, "schema": "messages"},
        {"kind": "parquet", "path": sharegpt, "schema": "sharegpt"},
        {"kind": "jsonl", "path": gsm, "schema": "instruction",
         "fields": {"instruction": "question", "response": "answer"}},
        {"kind": "jsonl", "path": alpaca, "schema": "instruction"},
    )
    convs = load_prompts(cfg)
    assert len(convs) == 6 + 5 + 4 + 3
    by_first_user = {c.messages[1 if c.messages[0]["role"] == "system" else 0]["content"]: c for c in convs}
    multi = by_first_user["m3"]
    assert [m["role"] for m in multi.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert multi.messages[4]["content"] == "b3"  # multi-turn kept whole
    assert by_first_user["s2"].messages == [{"role": "user", "content": "s2"}, {"role": "assistant", "content": "r2"}]
    assert by_first_user["q1"].messages == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "1"}]
    assert by_first_user["sum\n\n2 2"].messages[-1] == {"role": "assistant", "content": "4"}
    assert len({c.id for c in convs}) == len(convs)
    assert {c.source for c in convs} == {f"jsonl:{messages}", f"parquet:{sharegpt}", f"jsonl:{gsm}", f"jsonl:{alpaca}"}


def test_dedup_and_determinism(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"p{i % 10}"}]} for i in range(30)]  # each prompt 3x
    path = write_jsonl(tmp_path / "dup.jsonl", rows)
    src = {"kind": "jsonl", "path": path}
    first = load_prompts(data_cfg(src, seed=1))
    assert sorted(user_texts(first)) == sorted(f"p{i}" for i in range(10))
    assert [c.id for c in load_prompts(data_cfg(src, seed=1))] == [c.id for c in first]
    assert [c.id for c in load_prompts(data_cfg(src, seed=2))] != [c.id for c in first]
    kept = load_prompts(data_cfg(src, dedup=False))
    assert len(kept) == 30 and len({c.id for c in kept}) == 30  # duplicates kept, ids still unique


def test_mixing_by_weight_respects_both_caps(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"messages": [{"role": "user", "content": f"a{i}"}]} for i in range(100)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"messages": [{"role": "user", "content": f"b{i}"}]} for i in range(100)])

    def count(convs, prefix):
        return sum(t.startswith(prefix) for t in user_texts(convs))

    mixed = load_prompts(
        data_cfg({"kind": "jsonl", "path": a, "weight": 3}, {"kind": "jsonl", "path": b}, max_samples=40)
    )
    assert (count(mixed, "a"), count(mixed, "b")) == (30, 10)
    capped = load_prompts(data_cfg(
        {"kind": "jsonl", "path": a, "weight": 3, "max_samples": 5}, {"kind": "jsonl", "path": b}, max_samples=40
    ))
    assert (count(capped, "a"), count(capped, "b")) == (5, 35)  # a's cap frees its share for b


def test_mix_quotas():
    assert mix_quotas([100, 100], [3.0, 1.0], 40) == [30, 10]
    assert mix_quotas([5, 100], [3.0, 1.0], 40) == [5, 35]
    assert mix_quotas([10, 10, 10], [1.0, 1.0, 1.0], 10) == [4, 3, 3]
    assert mix_quotas([3, 4], [1.0, 1.0], 100) == [3, 4]
    assert mix_quotas([3, 4], [1.0, 1.0], None) == [3, 4]


def test_split_heldout_is_deterministic_and_disjoint(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": f"p{i}"}]} for i in range(20)])
    convs = load_prompts(data_cfg({"kind": "jsonl", "path": path}))
    train, held = split_heldout(convs, 5, seed=0)
    assert len(train) == 15 and len(held) == 5
    assert not {c.id for c in train} & {c.id for c in held}
    assert [c.id for c in split_heldout(convs, 5, seed=0)[1]] == [c.id for c in held]
    assert split_heldout(convs, 0, seed=0) == (convs, [])
    with pytest.raises(ConfigError, match="heldout_samples"):
        split_heldout(convs, 20, seed=0)


def test_missing_file_names_the_source(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ConfigError, match=r"data\.sources\[0\].*not found.*nope\.jsonl"):
        load_prompts(data_cfg({"kind": "jsonl", "path": str(missing)}))


def test_unreachable_hub_dataset_is_a_config_error():
    """Offline (HF_HUB_OFFLINE=1 in tests) and not cached: one clear line, no traceback."""
    cfg = data_cfg({"kind": "hf", "path": "HuggingFaceH4/ultrachat_200k", "split": "train_sft"})
    with pytest.raises(ConfigError) as err:
        load_prompts(cfg)
    text = str(err.value)
    assert "HuggingFaceH4/ultrachat_200k" in text and "unreachable" in text and "offline" in text
    assert err.value.__cause__ is None and err.value.__suppress_context__


def test_wrong_columns_and_fields_name_the_fix(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(ConfigError, match=r"needs a column 'instruction'.*fields\.instruction"):
        load_prompts(data_cfg({"kind": "jsonl", "path": path, "schema": "instruction"}))
    with pytest.raises(ConfigError, match=r"needs a column 'text'.*fields\.text"):
        load_prompts(data_cfg({"kind": "jsonl", "path": path, "schema": "text"}))


@pytest.mark.parametrize("source, message", [
    ({"schema": "instruction", "fields": {"prompt": "question"}}, "not fields of schema 'instruction'"),
    ({"schema": "text", "fields": {"content": "code"}}, r"\['content'\] are not fields of schema 'text'.*'completion', 'text'"),
    ({"schema": "text", "fields": {"text": " "}}, "map to an empty column name"),
    ({"schema": "plain"}, "schema"),
    ({"schema": "text", "weight": 0}, "weight"),
    ({"schema": "text", "ratio": 2}, "unknown key"),
])
def test_invalid_source_fields_fail_at_load_time_naming_the_key(tmp_path, source, message):
    from peagle.config import parse_config

    with pytest.raises(ConfigError, match=message) as err:
        parse_config({"name": "x", "target": {"model": "embedded"},
                      "data": {"sources": [{"kind": "jsonl", "path": "d.jsonl", **source}]}}, "c.yaml")
    assert "data.sources.0" in str(err.value)


def test_text_schema_is_completion_traffic(tmp_path):
    path = write_jsonl(tmp_path / "code.jsonl", [
        {"code": "def f():\n", "ref": "    return 1\n"}, {"code": "import os\n"}, {"code": "  "}, {"code": 3},
    ])
    convs = load_prompts(data_cfg({"kind": "jsonl", "path": path, "schema": "text",
                                   "fields": {"text": "code", "completion": "ref"}}))
    assert sorted((c.messages for c in convs), key=len) == [
        [{"role": "prompt", "content": "import os\n"}],
        [{"role": "prompt", "content": "def f():\n"}, {"role": "completion", "content": "    return 1\n"}],
    ]  # empty and non-text documents are skipped


def test_chat_and_text_sources_mix_by_weight(tmp_path):
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": f"c{i}"}]} for i in range(50)])
    docs = write_jsonl(tmp_path / "docs.jsonl", [{"text": f"doc {i}\n"} for i in range(50)])
    mixed = load_prompts(data_cfg({"kind": "jsonl", "path": chat, "weight": 1},
                                  {"kind": "jsonl", "path": docs, "schema": "text", "weight": 4}, max_samples=20))
    kinds = [c.messages[0]["role"] for c in mixed]
    assert (kinds.count("user"), kinds.count("prompt")) == (4, 16)
    assert kinds != sorted(kinds)  # shuffled together, not one block after the other


def test_malformed_rows_are_skipped(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [
        {"messages": [{"role": "user", "content": "good"}, {"role": "assistant", "content": "yes"}]},
        {"messages": [{"role": "assistant", "content": "no user turn"}]},
        {"messages": [{"role": "user", "content": "   "}]},
        {"messages": []},
    ])
    convs = load_prompts(data_cfg({"kind": "jsonl", "path": path}))
    assert [c.messages[0]["content"] for c in convs] == ["good"]


def test_split_keeps_earlier_assignments_when_prompts_grow():
    from peagle.data.prompts import Conversation, split_heldout

    def convs(n):
        return [Conversation(id=f"c{i}", messages=[{"role": "user", "content": str(i)}], source="t") for i in range(n)]

    train, held = split_heldout(convs(40), 8, seed=0)
    before = {c.id: "train" for c in train} | {c.id: "eval" for c in held}
    train2, held2 = split_heldout(convs(48), 8, seed=0, previous=before)
    assert {c.id for c in held2} == {c.id for c in held}  # held-out set unchanged
    assert {c.id for c in train2} == {c.id for c in train} | {f"c{i}" for i in range(40, 48)}


def test_skipped_rows_are_counted_and_named(tmp_path, caplog):
    rows = [{"messages": [{"role": "user", "content": f"m{i}"}]} if i % 5 != 2 else {"prompt": f"p{i}"}
            for i in range(400)]
    rows[30] = {"messages": [{"role": "robot", "content": "beep"}]}
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with caplog.at_level("WARNING", logger="peagle.data.prompts"):
        convs = load_prompts(data_cfg({"kind": "jsonl", "path": path}))
    assert len(convs) == 319
    assert (f"data.sources[0] (jsonl:{path}): kept 319 of 400 rows: 80 rows have no `messages` (first: line 3); "
            "1 row has a turn whose `role` is not one of") in caplog.text


def test_a_source_with_no_usable_row_is_an_error(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    path = tmp_path / "empty.jsonl"
    path.write_text("\n" + "".join(json.dumps({"messages": [], "n": i}) + "\n" for i in range(4)))
    with pytest.raises(ConfigError, match=r"data\.sources\[1\] \(jsonl:.*empty\.jsonl\): none of its 4 rows is usable: "
                                          r"4 rows have no `messages` \(first: line 2\); fix the rows"):
        load_prompts(data_cfg({"kind": "jsonl", "path": good}, {"kind": "jsonl", "path": str(path)}))
