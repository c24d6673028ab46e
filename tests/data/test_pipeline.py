"""build_dataset: resumable, refuses mixed configurations, and (slow) end to end in vLLM."""

import json
from pathlib import Path

import pytest
import torch

from peagle.config import ConfigError, parse_config
from peagle.data.pipeline import (
    Record,
    append_samples,
    build_dataset,
    plan_build,
    plan_records,
    previous_samples,
    read_samples,
    regeneration_key,
    render_records,
    write_samples,
)
from peagle.data.prompts import load_prompts
from peagle.data.store import ShardReader
from peagle.facts import TargetFacts
from peagle.layout import BUILD_FILE, RunLayout
from tests.cores import needs_cores

CONVERSATIONS = [
    [{"role": "user", "content": "Write a function that adds two numbers."},
     {"role": "assistant", "content": "def add(a, b):\n    return a + b\n"}],
    [{"role": "system", "content": "You write Python."},
     {"role": "user", "content": "Reverse a string."},
     {"role": "assistant", "content": "def rev(s):\n    return s[::-1]\n"},
     {"role": "user", "content": "Now for a list."},
     {"role": "assistant", "content": "def rev_list(xs):\n    return xs[::-1]\n"}],
    [{"role": "user", "content": "Explain what a hash map is."}],
] + [
    [{"role": "user", "content": f"Print the square of {i}."},
     {"role": "assistant", "content": f"print({i} * {i})"}]
    for i in range(9)
]


def make_cfg(tmp_path, prompts_path, target="embedded", **data):
    return parse_config(cfg_dict(tmp_path, prompts_path, target, **data))


def cfg_dict(tmp_path, prompts_path, target="embedded", **data):
    return {
        "name": "t",
        "workdir": str(tmp_path / "run"),
        "target": {"model": target, "dtype": "float32"},  # vLLM on CPU would pick bfloat16 for "auto"
        "vllm": {"max_model_len": 192, "max_num_seqs": 8, "cpu_kvcache_space_gib": 1},
        "data": {
            "sources": [{"kind": "jsonl", "path": str(prompts_path)}],
            "heldout_samples": 3,
            "min_tokens": 8,
            "max_seq_len": 64,
            "aux_layer_ids": [1, 2, 3],
            "regenerate": {"max_tokens": 24, "batch_size": 4},
            "shard_max_tokens": 256,
            "draft_vocab_size": 64,
            "extract_batch_size": 4,
            **data,
        },
        "train": {"recipe": {"max_len": 64}, "peagle": {"k_train": 5}},  # eval.ks (1, 3, 5) within it
        "eval": {"max_tokens": 16, "prompts": ["data/prompts/code_eval.jsonl"]},
    }


@pytest.fixture
def prompts_path(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    return path


def small_facts(vocab_size=384):
    return TargetFacts(
        target="t", target_revision=None, target_num_layers=4, target_hidden_size=64, vocab_size=vocab_size,
        target_num_heads=4, target_num_kv_heads=2, target_head_dim=None, target_intermediate_size=128,
        rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=512,
        aux_layer_ids=[1, 2, 3], final_layer_id=4, mask_token_id=6,
    )


def test_other_configuration_is_refused_before_any_work(tmp_path, prompts_path, tiny_tokenizer_dir):
    cfg = make_cfg(tmp_path, prompts_path)
    data_dir = cfg.run_dir / "data"
    data_dir.mkdir(parents=True)
    (data_dir / BUILD_FILE).write_text(json.dumps({"config_hash": "0123456789abcdef"}))
    with pytest.raises(ConfigError, match="another configuration.*--force"):
        build_dataset(cfg, str(tiny_tokenizer_dir), small_facts(), progress=False)
    assert sorted(p.name for p in cfg.run_dir.iterdir()) == ["data"]  # nothing written beside it


def test_a_bad_input_fails_before_anything_is_removed_or_written(tmp_path, prompts_path, tiny_tokenizer_dir):
    """--force with a prompt path that does not exist: refused while loading the prompts; the
    dataset of another configuration is left byte for byte, and no build.json of the failed
    configuration makes the next (correct) run refuse."""
    cfg = make_cfg(tmp_path, tmp_path / "no-such-prompts.jsonl")
    data_dir = cfg.run_dir / "data"
    (data_dir / "splits" / "train").mkdir(parents=True)
    (data_dir / "splits" / "train" / "shard-00000.safetensors").write_bytes(b"hours of work")
    (data_dir / BUILD_FILE).write_text(json.dumps({"config_hash": "0123456789abcdef"}))
    before = {p: p.read_bytes() for p in cfg.run_dir.rglob("*") if p.is_file()}
    with pytest.raises(Exception, match="no-such-prompts.jsonl"):
        build_dataset(cfg, str(tiny_tokenizer_dir), small_facts(), progress=False, force=True)
    assert {p: p.read_bytes() for p in cfg.run_dir.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in cfg.run_dir.iterdir()) == ["data"]


def test_force_builds_beside_the_old_dataset_and_touches_nothing(tmp_path):
    run = RunLayout(tmp_path / "run")
    data_dir = run.data.root
    (data_dir / "splits" / "train").mkdir(parents=True)
    (data_dir / "splits" / "train" / "shard-00000.safetensors").write_bytes(b"x")
    (data_dir / "samples.jsonl").write_text('{"id": "a"}\n')
    (data_dir / BUILD_FILE).write_text(json.dumps({"config_hash": "old"}))
    before = {p: p.read_bytes() for p in data_dir.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match="another configuration.*--force.*old one stays"):
        plan_build(run, "new", force=False, repair=False)
    with pytest.raises(ConfigError, match="--repair mends a dataset with the configuration it was built with"):
        plan_build(run, "new", force=False, repair=True)
    plan = plan_build(run, "new", force=True, repair=False)
    assert plan.layout.root == run.data_rebuild("new").root and plan.layout.root.is_dir()
    assert plan.final.root == data_dir and plan.replaces == "old" and plan.reuse == (run.data.samples,)
    assert {p: p.read_bytes() for p in data_dir.rglob("*") if p.is_file()} == before
    # The rebuild is resumed by a later run of the same configuration, --force or not.
    again = plan_build(run, "new", force=False, repair=False)
    assert again.layout.root == plan.layout.root
    assert plan_build(run, "old", force=False, repair=False).in_place  # the old configuration: its own dataset


def test_a_first_build_goes_in_place(tmp_path):
    run = RunLayout(tmp_path / "run")
    plan = plan_build(run, "h", force=False, repair=False)
    assert plan.in_place and plan.layout.root == run.data.root
    assert not run.data.build.exists()  # build.json is written when a build completes, never before


def test_the_disk_is_checked_before_any_vllm_work(tmp_path, prompts_path, tiny_tokenizer_dir, small_disk, caplog):
    """A disk too small for what the build will write (every split, vLLM's scratch files, the
    regenerated text) is refused before an engine starts, and the message says what needs it."""
    import re

    from peagle.data.errors import DiskSpaceError

    disk = small_disk(1 << 20)
    cfg = parse_config({**cfg_dict(tmp_path, prompts_path), "workdir": str(disk.path / "run")})
    caplog.set_level("INFO", logger="peagle.data")
    with pytest.raises(DiskSpaceError) as info:
        build_dataset(cfg, str(tiny_tokenizer_dir), small_facts(), progress=False)
    message = str(info.value)
    assert f"(on {disk.path})" in message, message
    needs = re.search(r"this data build \((.*)\) needs", message).group(1)
    assert [part.rsplit(" ", 2)[0] for part in needs.split(" + ")] == [
        "train shards", "eval shards", "served shards", "vLLM scratch files", "regenerated text"], needs
    assert "starting vLLM" not in caplog.text
    assert not (disk.path / "run" / "data" / BUILD_FILE).exists()


def test_a_stored_dataset_too_big_for_the_disk_is_refused_before_any_work(tmp_path, prompts_path, tiny_tokenizer_dir,
                                                                         small_disk):
    """12 prompts of up to 64 tokens x 4 layers x 64 in bf16 (~400 KB) on a 256 KiB disk: refused at
    once, every sequence at its longest, naming streaming; nothing is written."""
    from peagle.data.errors import DiskSpaceError

    disk = small_disk(256 << 10)
    cfg = parse_config({**cfg_dict(tmp_path, prompts_path), "workdir": str(disk.path / "run")})
    with pytest.raises(DiskSpaceError, match="set data.hidden_states: streamed") as info:
        build_dataset(cfg, str(tiny_tokenizer_dir), small_facts(), progress=False)
    assert "12 samples of up to 64 tokens" in str(info.value)
    assert not (disk.path / "run" / "data" / "samples.jsonl").exists()


def test_draft_vocab_larger_than_target_is_refused(tmp_path, prompts_path):
    cfg = make_cfg(tmp_path, prompts_path, draft_vocab_size=1000)
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        build_dataset(cfg, "/nonexistent/target", small_facts(vocab_size=384), progress=False)


def test_render_filters_say_why(tmp_path, prompts_path, make_tokenizer, templates):
    cfg = make_cfg(tmp_path, prompts_path, min_tokens=10)
    tok = make_tokenizer(templates["plain"])
    long_answer = "x = 1\n" * 40
    records = [
        Record("ok", "train", "s", CONVERSATIONS[0]),
        Record("short", "train", "s", [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]),
        Record("no-assistant", "train", "s", CONVERSATIONS[2]),
        Record("long", "train", "s", [{"role": "user", "content": "go"},
                                      {"role": "assistant", "content": long_answer}]),
        Record("late", "train", "s", [{"role": "user", "content": "y = 2\n" * 40},
                                      {"role": "assistant", "content": "z"}]),
        Record("regen", "train", "s", CONVERSATIONS[0], regen="failed: prompt too long"),
    ]
    render_records(tok, records, cfg, max_len=32, progress=False)
    status = {r.id: r.status for r in records}
    assert status["ok"] == "ok" and records[0].token_ids.numel() == records[0].num_tokens and records[0].loss_mask.any()
    assert status["short"].startswith("failed: too short")
    assert status["no-assistant"] == "failed: no assistant tokens to learn from"
    long = records[3]
    assert long.status == "ok" and long.truncated_from > 32 and len(long.token_ids) == long.num_tokens == 32
    assert status["late"].startswith("failed: no assistant tokens within the first 32")
    assert status["regen"] == "failed: regeneration: prompt too long"


def test_samples_file_survives_a_cut_line_and_ends_one_line_per_prompt(tmp_path):
    path = tmp_path / "samples.jsonl"
    a = Record("a", "train", "s", CONVERSATIONS[0], regen="ok")
    append_samples(path, [a, Record("b", "eval", "s", CONVERSATIONS[1], regen="ok")])
    a.messages = CONVERSATIONS[3]
    append_samples(path, [a])
    with open(path, "a") as fh:
        fh.write('{"id": "c", "mess')  # a crash mid-line
    previous = read_samples(path)
    assert set(previous) == {"a", "b"} and previous["a"]["messages"] == CONVERSATIONS[3]
    write_samples(path, [a, Record("b", "eval", "s", CONVERSATIONS[1], status="failed: x")])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [d["id"] for d in lines] == ["a", "b"] and lines[1]["status"] == "failed: x"


def test_a_rerun_restores_regenerated_responses_of_the_same_key(tmp_path, prompts_path):
    cfg = make_cfg(tmp_path, prompts_path)
    run = RunLayout(cfg.run_dir)
    run.data.root.mkdir(parents=True)
    prompts = load_prompts(cfg.data)
    plan = plan_build(run, cfg.section_hash("target", "data"), force=False, repair=False)
    key = regeneration_key(cfg, "local:abc")
    first = plan_records(cfg, prompts, previous_samples(plan), key)
    assert all(r.regen is None for r in first)
    done = first[0]
    done.messages = done.messages[:1] + [{"role": "assistant", "content": "WRITTEN BY THE TARGET"}]
    done.regen, done.regen_key = "ok", key
    append_samples(run.data.samples, [done])
    again = plan_records(cfg, prompts, previous_samples(plan), key)
    assert [r.id for r in again] == [r.id for r in first]
    restored = [r for r in again if r.regen is not None]
    assert len(restored) == 1 and restored[0].messages[-1]["content"] == "WRITTEN BY THE TARGET"
    # Another target revision (or regeneration setting) regenerates: nothing is restored.
    other = regeneration_key(cfg, "local:def")
    assert other != key and regeneration_key(cfg.model_copy(update={"data": cfg.data.model_copy(
        update={"regenerate": cfg.data.regenerate.model_copy(update={"max_tokens": 99})})}), "local:abc") != key
    assert all(r.regen is None for r in plan_records(cfg, prompts, previous_samples(plan), other))
    # A setting regeneration does not read keeps the key.
    assert regeneration_key(cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_seq_len": 32})}),
                            "local:abc") == key


# ----------------------------------------------------------------------------- end to end (vLLM)


def hf_states(target_dir, token_ids, layer_ids):
    """The reference: HF hidden_states[k] for aux layers, the last layer's output (pre-norm) for k = L."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    captured = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda _m, _i, out: captured.setdefault("last", out[0] if isinstance(out, tuple) else out)
    )
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), output_hidden_states=True)
    hook.remove()
    num_layers = model.config.num_hidden_layers
    return torch.stack(
        [captured["last"][0] if k == num_layers else out.hidden_states[k][0] for k in layer_ids], dim=1
    )


@pytest.mark.slow
@pytest.mark.timeout(400)  # a data stage, interrupted and resumed (~75 s)
def test_build_dataset_end_to_end_and_resume(tmp_path, prompts_path, caplog):
    from transformers import AutoConfig, AutoTokenizer

    from peagle.data.chat import render_with_loss_mask
    from peagle.data.store import ShardReader
    from peagle.data.vocab import DraftVocab
    from peagle.facts import load_dataset_facts, target_facts_from_target
    from peagle.layout import DataLayout
    from peagle.testing.tiny import build_tiny_llama

    target = build_tiny_llama(tmp_path / "target")
    cfg = make_cfg(tmp_path, prompts_path, target=str(target))
    tok = AutoTokenizer.from_pretrained(target)
    spec = target_facts_from_target(cfg, AutoConfig.from_pretrained(target), tok)

    info = build_dataset(cfg, str(target), spec)
    assert info.num_train + info.num_eval + info.num_failed == len(CONVERSATIONS)
    assert info.num_eval <= 3 and info.num_train >= 6
    lines = [json.loads(x) for x in (info.data_dir / "samples.jsonl").read_text().splitlines()]
    assert sorted(d["id"] for d in lines) == sorted({d["id"] for d in lines})  # one line per prompt
    assert all(d["regen"] == "ok" for d in lines)
    ok = {d["id"]: d for d in lines if d["status"] == "ok"}
    assert len(ok) == info.num_train + info.num_eval

    train = ShardReader(info.train_dir)
    assert len(train) == info.num_train and train.num_shards >= 2 and train.layer_ids == [1, 2, 3, 4]
    sample = train[0]
    ids, mask = render_with_loss_mask(tok, ok[sample.id]["messages"])
    assert sample.token_ids.tolist() == ids[:64] and sample.loss_mask.tolist() == mask[:64]
    ref = hf_states(target, sample.token_ids.tolist(), [1, 2, 3, 4])
    assert ((sample.hidden - ref).abs() <= 2**-8 * ref.abs() + 1e-4).all()  # bf16 storage of vLLM's states

    vocab = DraftVocab.load(info.vocab_path)
    assert vocab.size == 64 and torch.equal(vocab.draft_ids, torch.arange(64) + vocab.d2t)
    facts = load_dataset_facts(DataLayout(info.data_dir))
    assert facts == TargetFacts.load(info.facts_path) == spec.with_draft_vocab(64)
    assert not (Path(info.data_dir) / "head_spec.json").exists()  # no drafter shape in the dataset
    assert json.loads((info.train_dir / "manifest.json").read_text())["config_hash"] == info.config_hash

    # The served split: the eval prompts as the online evaluation sends them, then the target's
    # greedy tokens (max_tokens + max K of them), supervised; what offline acceptance simulates on.
    from transformers import LlamaForCausalLM

    from peagle.data.served import SERVED_SPLIT, eval_token_prompts

    served = ShardReader(DataLayout(info.data_dir).split(SERVED_SPLIT))
    prompts = eval_token_prompts(cfg, tok)
    assert len(served) == len(prompts) > 0 and served.manifest["max_tokens"] == 16
    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for i in (0, len(served) - 1):
        s, n = served[i], len(prompts[i])
        assert s.token_ids[:n].tolist() == prompts[i] and not s.loss_mask[:n].any() and s.loss_mask[n:].all()
        with torch.no_grad():
            greedy = model.generate(torch.tensor([prompts[i]]), max_new_tokens=16 + 5, do_sample=False)[0, n:]
        assert s.token_ids[n:].tolist() == greedy.tolist()

    # Rerun with nothing to do: no engine, same dataset.
    caplog.set_level("INFO", logger="peagle.data")
    caplog.clear()
    again = build_dataset(cfg, str(target), spec)
    assert "starting vLLM" not in caplog.text
    assert (again.num_train, again.num_eval, again.num_tokens) == (info.num_train, info.num_eval, info.num_tokens)

    # A crash before the eval split was written: the rerun extracts it again but does not
    # regenerate (a marker put into the saved response survives into the shards).
    import shutil

    shutil.rmtree(info.eval_dir)
    eval_id = next(d["id"] for d in lines if d["split"] == "eval" and d["status"] == "ok")
    marked = [dict(d) for d in lines]
    for d in marked:
        if d["id"] == eval_id:
            d["messages"][-1]["content"] = "MARKER " + d["messages"][-1]["content"]
    (info.data_dir / "samples.jsonl").write_text("".join(json.dumps(d) + "\n" for d in marked))
    caplog.clear()
    resumed = build_dataset(cfg, str(target), spec)
    assert "starting vLLM" in caplog.text and "regenerated responses restored" in caplog.text
    assert resumed.num_eval == info.num_eval and resumed.num_train == info.num_train
    stored = {s.id: s for s in ShardReader(resumed.eval_dir)}
    marker_ids = tok("MARKER", add_special_tokens=False)["input_ids"]
    token_text = stored[eval_id].token_ids.tolist()
    assert any(token_text[i : i + len(marker_ids)] == marker_ids for i in range(len(token_text)))

    with pytest.raises(ConfigError, match="another configuration"):
        build_dataset(make_cfg(tmp_path, prompts_path, target=str(target), draft_vocab_size=32), str(target), spec)


@pytest.mark.slow
@needs_cores(2)
@pytest.mark.timeout(600)  # two engine replicas, one killed, and a rerun (~145 s)
def test_two_replicas_build_one_store_and_a_rerun_resumes_after_one_dies(tmp_path):
    """``vllm.data_parallel_size: 2`` through ``peagle data``, as a user runs it: one replica is
    killed mid-extraction; the command fails saying so, and a rerun finishes the same store
    with every sample exactly once, keeping (not redoing) what was stored before."""
    import subprocess
    import sys
    import time

    import psutil
    import yaml

    from peagle.data.store import ShardReader
    from peagle.layout import RunLayout
    from peagle.testing.tiny import build_tiny_llama

    target = build_tiny_llama(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"Print the square of {i}, then of {i + 1}."}]}) + "\n"
        for i in range(60)
    ))
    cfg = cfg_dict(tmp_path, prompts, target=str(target), shard_max_tokens=256, extract_batch_size=4, heldout_samples=6)
    cfg["vllm"]["data_parallel_size"] = 2
    cfg_path = tmp_path / "dp2.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    data = RunLayout(parse_config(cfg).run_dir).data
    command = [sys.executable, "-m", "peagle.cli", "data", str(cfg_path)]

    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while not list(data.train.glob("*.safetensors")) and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    replicas = [p for p in psutil.Process(run.pid).children() if "spawn_main" in " ".join(p.cmdline())]
    assert len(replicas) == 2, f"expected 2 engine replicas under peagle data, found {replicas}"
    replicas[0].kill()
    out, _ = run.communicate(timeout=300)
    assert run.returncode == 1, out
    assert "engine replica" in out and "exited with code -9" in out and "rerun to resume" in out, out
    before = {s.id: s.token_ids for s in ShardReader(data.train)}
    assert before, "the first run stored nothing before the replica died"
    first_shards = {p.name: p.read_bytes() for p in data.train.glob("*.safetensors")}

    again = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert again.returncode == 0, again.stdout
    assert "regenerated responses restored" in again.stdout
    # the console shows our lines and progress bar; vLLM's output (its engine processes' too) is in the log
    library_log = RunLayout(parse_config(cfg).run_dir).library_log
    assert "extract hidden states" in again.stdout and str(library_log) in again.stdout
    assert "Loading safetensors checkpoint shards" in library_log.read_text()
    assert "Loading safetensors checkpoint shards" not in again.stdout, again.stdout
    lines = [json.loads(x) for x in data.samples.read_text().splitlines()]
    ok = {d["split"]: set() for d in lines}
    for d in lines:
        if d["status"] == "ok":
            ok[d["split"]].add(d["id"])
    assert sum(map(len, ok.values())) >= 55
    for split in ("train", "eval"):
        stored = [s.id for s in ShardReader(data.split(split), verify="full")]
        assert len(stored) == len(set(stored)), f"duplicate samples in {split}"
        assert set(stored) == ok[split], f"{split}: missing {ok[split] - set(stored)}, extra {set(stored) - ok[split]}"
    import re

    redone = int(re.search(r"data: (\d+) sequences .* to extract", again.stdout).group(1))
    assert redone == sum(map(len, ok.values())) - len(before)  # the stored samples were not extracted again
    assert all(data.train.joinpath(name).read_bytes() == blob for name, blob in first_shards.items())


# ----------------------------------------------------------------------------- the CLI as users run it (vLLM)


def peagle(*args: str, timeout: float = 600):
    """``peagle ARGS`` as a user runs it (a CompletedProcess); stdout and stderr together."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "peagle.cli", *map(str, args)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


def tiny_data_config(tmp_path, workdir=None, **data) -> tuple:
    """(config file, RunLayout) of a run on a tiny Llama (vLLM-servable) and the test prompts."""
    import yaml

    from peagle.testing.tiny import build_tiny_llama

    target = build_tiny_llama(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    cfg = cfg_dict(tmp_path, prompts, target=str(target), **data)
    if workdir is not None:
        cfg["workdir"] = str(workdir)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, RunLayout(parse_config(cfg).run_dir)


def tree_bytes(root) -> dict:
    """Every file under ``root`` (relative path -> bytes): a dataset compared byte for byte."""


    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


@pytest.mark.slow
@pytest.mark.timeout(400)  # two data stages on a small disk (~100 s)
def test_a_full_disk_stops_the_stage_at_once_and_a_rerun_resumes(tmp_path, small_disk):
    """The disk fills up during extraction: the command stops (no wait on a file vLLM could not
    write) naming the disk, what is kept and how to go on; once there is room, the same command
    finishes the dataset without extracting the kept samples again."""
    import re
    import time

    disk = small_disk(900 << 10)
    config, run = tiny_data_config(tmp_path, workdir=disk.path / "run")
    started = time.monotonic()
    full = peagle("data", config, "--force")  # past the space checks (they only warn): the disk really fills
    seconds = time.monotonic() - started
    assert full.returncode == 1, full.stdout
    assert f"the disk holding {run.data.root} ({disk.path}) is full" in full.stdout, full.stdout
    assert "No space left on device" in full.stdout and "rerun the same command" in full.stdout
    kept, kept_eval = map(int, re.search(r"Kept in \S+: (\d+) train, (\d+) eval", full.stdout).groups())
    assert kept > 0 and "12 regenerated responses" in full.stdout
    assert seconds < 300, f"{seconds:.0f} s"  # vLLM's start and the regeneration; the failure itself is immediate
    kept_shards = tree_bytes(run.data.train)
    assert json.loads(kept_shards["manifest.json"])["num_samples"] == kept

    disk.resize(64 << 20)  # the user frees space
    resumed = peagle("data", config)
    assert resumed.returncode == 0, resumed.stdout
    assert "12 regenerated responses restored" in resumed.stdout and "regenerate:" not in resumed.stdout
    todo = int(re.search(r"data: (\d+) sequences .* to extract", resumed.stdout).group(1))
    stored = ShardReader(run.data.train, verify="full")
    # the kept samples (where the disk filled decides how many of each split) were not extracted again
    assert todo == len(stored) + len(ShardReader(run.data.eval)) - kept - kept_eval
    assert len(set(stored.sample_ids())) == len(stored)
    assert all(tree_bytes(run.data.train).get(name) == blob for name, blob in kept_shards.items()
               if name.startswith("shard-"))


@pytest.mark.slow
@pytest.mark.timeout(900)  # a data stage interrupted, resumed, refused twice and rebuilt (~150-400 s by the machine)
def test_ctrl_c_stops_the_data_stage_a_rerun_resumes_and_force_never_destroys_what_it_built(tmp_path):
    """One run directory as a user lives with it. Ctrl-C during regeneration stops the stage within
    seconds, saying what is kept; the same command resumes it to a whole dataset. Then --force with
    a typo in a prompt path is refused while loading the prompts, the dataset byte for byte as it
    was, and the next correct run needs no --force. A changed data.storage_dtype is refused without
    --force; with it, the rebuild reuses every regenerated response and replaces the dataset whole."""
    import os
    import signal
    import subprocess
    import sys
    import time

    config, run = tiny_data_config(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "peagle.cli", "data", str(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    os.set_blocking(proc.stdout.fileno(), False)
    out = b""
    deadline = time.monotonic() + 600
    while b"regenerate:" not in out and proc.poll() is None and time.monotonic() < deadline:
        out += proc.stdout.read() or b""
        time.sleep(0.05)
    assert proc.poll() is None, out.decode()
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends: the whole foreground group
    interrupted = time.monotonic()
    while proc.poll() is None and time.monotonic() - interrupted < 60:
        out += proc.stdout.read() or b""
        time.sleep(0.05)
    seconds = time.monotonic() - interrupted
    out += proc.stdout.read() or b""
    text = out.decode(errors="replace")
    assert proc.returncode == 130, text
    assert seconds < 10, f"{seconds:.1f} s after Ctrl-C"
    assert "data: interrupted. Kept in" in text and "Rerun the same command" in text, text

    built = peagle("data", config)
    assert built.returncode == 0, built.stdout
    assert len(ShardReader(run.data.train, verify="full")) > 0 and run.data.build.exists()
    before = tree_bytes(run.data.root)
    responses = {d["id"]: d["messages"] for d in map(json.loads, run.data.samples.read_text().splitlines())}

    typo = peagle("data", config, "--force", "--set",
                  f'data.sources=[{{kind: jsonl, path: "{tmp_path / "promts.jsonl"}"}}]')
    assert typo.returncode != 0 and "promts.jsonl" in typo.stdout, typo.stdout
    assert "starting vLLM" not in typo.stdout
    assert tree_bytes(run.data.root) == before
    assert not run.data_rebuilds()

    again = peagle("data", config)  # the run as it was: nothing to do, no --force asked
    assert again.returncode == 0 and "starting vLLM" not in again.stdout, again.stdout
    assert tree_bytes(run.data.root) == before

    refused = peagle("data", config, "--set", "data.storage_dtype=float32")
    assert refused.returncode == 2 and "--force" in refused.stdout, refused.stdout
    assert tree_bytes(run.data.root) == before

    rebuilt = peagle("data", config, "--set", "data.storage_dtype=float32", "--force")
    assert rebuilt.returncode == 0, rebuilt.stdout
    assert f"{len(responses)} regenerated responses restored" in rebuilt.stdout
    assert "regenerate:" not in rebuilt.stdout  # no response written again
    assert {d["id"]: d["messages"] for d in map(json.loads, run.data.samples.read_text().splitlines())} == responses
    manifest = json.loads(run.data.manifest("train").read_text())
    assert json.loads(run.data.build.read_text())["config_hash"] == manifest["config_hash"] != json.loads(
        before["build.json"])["config_hash"]
    assert manifest["storage_dtype"] == "float32" and not run.data_rebuilds()
    assert len(ShardReader(run.data.train, verify="full")) == json.loads(before["splits/train/manifest.json"])[
        "num_samples"]
