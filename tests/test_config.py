"""Config validation: every mistake fails at load time with a message naming the key."""

from pathlib import Path

import pytest
import yaml
from transformers import LlamaConfig

from peagle.config import (
    DEMO_TARGET_LINE,
    ConfigError,
    apply_overrides,
    load_config,
    parse_config,
    parse_overrides,
    with_overrides,
    write_resolved_config,
)
from peagle.facts import default_aux_layer_ids, head_spec_for, target_facts_from_target

REPO = Path(__file__).resolve().parent.parent
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
BENCH_CONFIGS = sorted((REPO / "bench" / "configs").glob("*.yaml"))


def demo_dict() -> dict:
    return yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())


@pytest.mark.parametrize("path", CONFIGS + BENCH_CONFIGS, ids=[p.stem for p in CONFIGS + BENCH_CONFIGS])
def test_shipped_configs_validate(path):
    cfg = load_config(path)
    assert cfg.name
    assert cfg.eval.ks == sorted(cfg.eval.ks)


def test_real_target_configs_are_shipped():
    names = {p.stem for p in CONFIGS}
    assert {"demo", "llama-3.1-8b-instruct", "qwen3-8b", "gpt-oss-20b"} <= names


def test_a_config_without_its_target_is_refused_showing_the_demos_line(tmp_path):
    """No default target: a config that forgets it would otherwise train on the tiny test target."""
    data = demo_dict()
    del data["target"]["model"]
    message = _error(data)
    assert "target.model: required" in message and f"target: {{model: {DEMO_TARGET_LINE}}}" in message, message
    del data["target"]
    assert "  - target: required" in _error(data)
    demo = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    assert demo["target"]["model"] == DEMO_TARGET_LINE  # the line the message shows is the demo's


def _error(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, "x.yaml")
    return str(info.value)


def test_unknown_key_names_the_key():
    data = demo_dict()
    data["train"]["epocs"] = 3
    msg = _error(data)
    assert "train.epocs" in msg and "unknown key" in msg


def test_a_train_key_of_the_flat_section_names_its_block():
    """A config written before the train section had parts is refused with each key's new place."""
    data = demo_dict()
    data["train"] |= {"k_train": 4, "eagle3_baseline": True, "grad_accum": 2}
    msg = _error(data)
    assert "the train section is in parts" in msg and "train.k_train belongs at train.peagle.k_train" in msg
    assert "train.eagle3_baseline belongs at train.baseline.eagle3" in msg and "train.recipe.batch_size" in msg
    with pytest.raises(ConfigError, match="train.world_size belongs at train.launch.world_size"):
        load_config(REPO / "configs" / "tiny.yaml", parse_overrides(["train.world_size=2"]))


def test_a_batch_that_does_not_split_into_the_ranks_is_refused():
    data = demo_dict()
    data["train"]["launch"] = {"world_size": 2}
    assert "train.recipe.batch_size (1) must be a multiple of train.recipe.micro_batch_size x train.launch.world_size (2)" \
        in _error(data)
    data["train"]["recipe"]["batch_size"] = 4
    assert parse_config(data).train.grad_accum == 2


def test_unknown_top_level_section():
    data = demo_dict()
    data["trian"] = {}
    assert "trian" in _error(data)


def test_wrong_type_names_the_key():
    data = demo_dict()
    data["train"]["recipe"]["learning_rate"] = "fast"
    assert "train.recipe.learning_rate" in _error(data)


def test_k_below_one_is_refused():
    data = demo_dict()
    data["eval"]["ks"] = [0, 3]
    assert "eval.ks" in _error(data)
    data = demo_dict()
    data["train"]["peagle"]["k_train"] = 0
    assert "train.peagle.k_train" in _error(data)


def test_eval_ks_beyond_k_train_is_refused_for_the_methods_that_train_k_train_positions():
    data = demo_dict()
    data["eval"]["ks"] = [3, 7]
    msg = _error(data)
    assert "eval.ks [3, 7]: K = 7" in msg and "train.peagle.k_train = 5" in msg and "lower eval.ks to at most 5" in msg
    data["train"]["method"] = "eagle3"  # one draft per pass: served at any K
    assert parse_config(data).eval.ks == [3, 7]


def test_a_config_a_stage_derives_keeps_the_rules_a_loaded_one_keeps():
    """``stages.with_train`` (a method's head, its time budget, a warm start) validates what it derives."""
    from peagle.stages import with_train

    cfg = parse_config(demo_dict())
    assert with_train(cfg, {"recipe.max_train_seconds": 3.5, "recipe.max_steps": None}).train.recipe.max_train_seconds == 3.5
    with pytest.raises(ConfigError, match=r"K = 3, 5 is beyond the 1 draft positions.*raise train.peagle.k_train to 5"):
        with_train(cfg, {"peagle.k_train": 1})


def test_train_length_beyond_data_length_is_refused():
    data = demo_dict()
    data["train"]["recipe"]["max_len"] = data["data"]["max_seq_len"] + 1
    assert "train.recipe.max_len" in _error(data)


def test_aux_layer_ids_must_be_ascending_triplet():
    data = demo_dict()
    data["data"]["aux_layer_ids"] = [4, 2, 5]
    assert "data.aux_layer_ids" in _error(data)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_overrides_apply_and_are_validated():
    cfg = load_config(REPO / "configs" / "tiny.yaml", {"train.recipe.epochs": 5})
    assert cfg.train.recipe.epochs == 5
    with pytest.raises(ConfigError, match="train.recipe.epochs"):
        load_config(REPO / "configs" / "tiny.yaml", {"train.recipe.epochs": 0})


def test_set_values_are_yaml_scalars():
    assert parse_overrides(["train.recipe.epochs=3", "train.recipe.learning_rate=3e-4", "train.baseline.eagle3=false",
                            "workdir=null", "name=demo=2", " tracking.wandb.project = p "]) == {
        "train.recipe.epochs": 3, "train.recipe.learning_rate": "3e-4", "train.baseline.eagle3": False, "workdir": None,
        "name": "demo=2", "tracking.wandb.project": "p"}
    cfg = load_config(REPO / "configs" / "tiny.yaml",
                      parse_overrides(["train.recipe.learning_rate=3.0e-4", "train.recipe.epochs=3"]))
    assert cfg.train.recipe.learning_rate == 3.0e-4 and cfg.train.recipe.epochs == 3


@pytest.mark.parametrize("pair", ["train.recipe.epochs", "=3", "train.recipe.epochs=[unclosed"])
def test_a_malformed_set_names_itself(pair):
    with pytest.raises(ConfigError, match="--set"):
        parse_overrides([pair])


@pytest.mark.parametrize(("key", "named"), [
    ("train.recipe.epochs.max", "train.recipe.epochs is a value"),
    ("train..recipe", "empty key segment"),
    ("train.epochz", "train.epochz: unknown key"),
    ("trian.epochs", "trian: unknown key"),
])
def test_a_bad_key_path_names_the_key(key, named):
    with pytest.raises(ConfigError, match=named):
        load_config(REPO / "configs" / "tiny.yaml", {key: 3})


def test_overrides_on_a_loaded_config_and_on_a_mapping():
    base = load_config(REPO / "configs" / "tiny.yaml")
    cfg = with_overrides(base, {"train.recipe.epochs": 4, "tracking.wandb": {"enabled": False}})
    assert cfg.train.recipe.epochs == 4 and base.train.recipe.epochs != 4 and cfg.drafter == base.drafter
    with pytest.raises(ConfigError, match="train.peagle.k_train"):
        with_overrides(base, {"train.peagle.k_train": 0})
    data = {"train": None}
    assert apply_overrides(data, {"train.recipe.epochs": 2}) == {"train": {"recipe": {"epochs": 2}}}
    assert data == {"train": None}  # the caller's mapping is not changed


class _Tok:
    unk_token_id = None

    def __init__(self, vocab):
        self.vocab = vocab

    def convert_tokens_to_ids(self, token):
        return self.vocab.get(token)


def test_a_run_reads_back_exactly_its_resolved_config(tmp_path):
    """Subflows get this file's path, never the config (Prefect stores parameters)."""
    cfg = load_config(REPO / "configs" / "tiny.yaml", {
        "workdir": str(tmp_path / "run"), "tracking.tracking_uri": "postgresql://peagle:s3cret@db/mlflow",
        "train.recipe.learning_rate": 1e-5})
    path = write_resolved_config(cfg)
    assert path == cfg.run_dir / "config.resolved.json"
    assert load_config(path) == cfg  # 1e-05 stays a float: JSON, not YAML 1.1
    assert load_config(path, {"train.recipe.epochs": 3}).train.recipe.epochs == 3
    mtime = path.stat().st_mtime_ns
    assert write_resolved_config(cfg) == path and path.stat().st_mtime_ns == mtime  # unchanged: not rewritten
    path.write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(path)


def _target(num_layers=8):
    return LlamaConfig(vocab_size=100, hidden_size=64, num_hidden_layers=num_layers,
                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                       max_position_embeddings=2048)


def test_layer_ids_beyond_target_depth_are_refused():
    data = demo_dict()
    data["data"]["aux_layer_ids"] = [2, 4, 9]
    cfg = parse_config(data)
    with pytest.raises(ConfigError, match="beyond the target's depth"):
        target_facts_from_target(cfg, _target(8), _Tok({"<|mask|>": 7}))


def test_unknown_mask_token_is_refused():
    cfg = parse_config(demo_dict())
    with pytest.raises(ConfigError, match="target.mask_token"):
        target_facts_from_target(cfg, _target(8), _Tok({}))


def test_head_spec_defaults_follow_vllm():
    cfg = parse_config(demo_dict())
    spec = head_spec_for(cfg, target_facts_from_target(cfg, _target(8), _Tok({"<|mask|>": 7})))
    assert spec.aux_layer_ids == [2, 4, 5] == default_aux_layer_ids(8)
    assert spec.stored_layer_ids == [2, 4, 5, 8]
    assert spec.mask_token_id == 7
    assert spec.hidden_size == 64 and spec.target_hidden_size == 64
    with pytest.raises(ConfigError):
        default_aux_layer_ids(5)


@pytest.mark.parametrize("kv_heads, expected", [(None, 2), ("num_heads", 4), (1, 1)])
def test_drafter_kv_heads_follow_the_target_or_the_query_heads(kv_heads, expected):
    # The demo asks for a KV head per query head; a user's target keeps its own query heads.
    data = demo_dict()
    data["drafter"]["num_kv_heads"] = kv_heads
    cfg = parse_config(data)
    spec = head_spec_for(cfg, target_facts_from_target(cfg, _target(8), _Tok({"<|mask|>": 7})))
    assert (spec.num_heads, spec.num_kv_heads) == (4, expected)


def test_a_kv_head_count_that_is_not_a_number_or_num_heads_is_refused():
    data = demo_dict()
    data["drafter"]["num_kv_heads"] = "all"
    with pytest.raises(ConfigError, match="drafter.num_kv_heads"):
        parse_config(data)


# ----------------------------------------------------------------------------- extends


GPU_TARGETS = ["llama-3.1-8b-instruct", "qwen3-8b", "gpt-oss-20b"]


@pytest.mark.parametrize("name", GPU_TARGETS)
def test_each_gpu_config_is_the_gpu_recipe_with_its_target(name):
    own = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())
    assert own.pop("extends") == "gpu/base.yaml" and set(own) == {"name", "target"}, own
    cfg, base = load_config(REPO / "configs" / f"{name}.yaml"), yaml.safe_load(
        (REPO / "configs" / "gpu" / "base.yaml").read_text())
    assert cfg.target.model == own["target"]["model"]
    assert cfg.train.recipe.optimizer == base["train"]["recipe"]["optimizer"]
    assert cfg.data.max_samples == base["data"]["max_samples"]
    assert [s.path for s in cfg.data.sources] == [s["path"] for s in base["data"]["sources"]]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_config_extends_a_base_section_by_section_and_a_list_replaces(tmp_path):
    write(tmp_path / "recipes" / "base.yaml",
          "name: base\ntarget: {model: embedded}\ndata:\n  sources:\n    - {kind: jsonl, path: data/prompts/code_train.jsonl}\n"
          "train:\n  recipe: {epochs: 7}\n  peagle: {k_train: 4}\neval:\n  ks: [1, 2, 3]\n")
    mid = write(tmp_path / "recipes" / "mid.yaml", "extends: base.yaml\ntrain:\n  peagle: {k_train: 3}\n")
    top = write(tmp_path / "top.yaml", "extends: recipes/mid.yaml\nname: top\neval:\n  ks: [2]\n")
    cfg = load_config(top)
    assert (cfg.name, cfg.train.recipe.epochs, cfg.train.peagle.k_train, cfg.eval.ks) == ("top", 7, 3, [2])
    assert load_config(mid).eval.ks == [1, 2, 3]
    assert load_config(top, {"train.recipe.epochs": 2}).train.recipe.epochs == 2  # overrides apply last


def test_an_unknown_key_in_a_base_is_refused_naming_the_chain(tmp_path):
    base = write(tmp_path / "base.yaml", "train:\n  epocs: 3\n")
    top = write(tmp_path / "top.yaml", "extends: base.yaml\nname: top\n")
    with pytest.raises(ConfigError, match=r"train\.epocs: unknown key") as info:
        load_config(top)
    assert f"{top} (extends {base})" in str(info.value)


@pytest.mark.parametrize("extends, says", [
    ("missing.yaml", "is not a file: fix the path"),
    ("top.yaml", "makes a circle"),
    ("loop.yaml", "makes a circle"),
    ("[a, b]", "extends must name a config file"),
])
def test_a_base_that_cannot_be_read_is_refused_with_the_fix(tmp_path, extends, says):
    write(tmp_path / "loop.yaml", "extends: top.yaml\n")
    top = write(tmp_path / "top.yaml", f"extends: {extends}\nname: top\n")
    with pytest.raises(ConfigError, match=says):
        load_config(top)
