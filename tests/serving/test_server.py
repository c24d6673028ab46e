"""`peagle serve`'s plan: what the head's weights and card decide, and the command vLLM gets."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from peagle.export.card import HEAD_PLACEHOLDER, TARGET_PLACEHOLDER, serve_command
from peagle.export.serving_plan import plan_serving
from peagle.serving.server import api_server_argv


def head_dir(path, *, mask_hidden: bool, card_target: str | None = None, card_k: int = 4,
             card_name: str | None = None):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    tensors = {"fc.weight": np.zeros((4, 12), dtype=np.float32)}
    if mask_hidden:
        tensors["mask_hidden"] = np.zeros((1, 1, 12), dtype=np.float32)
    save_file(tensors, str(path / "model.safetensors"))
    if card_target is not None:
        line = serve_command(card_target, HEAD_PLACEHOLDER, card_k, parallel_drafting=True, served_name=card_name)
        (path / "README.md").write_text(f"# head\n\n```bash\n{line}\n```\n")
    return path


def test_parallel_drafting_follows_the_weights_not_the_card(tmp_path):
    # an EAGLE-3 head (no mask_hidden) whose card was edited to say parallel_drafting: true
    plan = plan_serving(head_dir(tmp_path / "h", mask_hidden=False, card_target="org/t"))
    assert (plan.target, plan.k, plan.parallel_drafting) == ("org/t", 4, False)
    assert plan.speculative_config() == {"model": str(tmp_path / "h"), "method": "eagle3",
                                         "num_speculative_tokens": 4, "parallel_drafting": False}


def test_options_override_the_card_and_a_local_target_is_made_absolute(tmp_path, monkeypatch):
    head = head_dir(tmp_path / "h", mask_hidden=True, card_target="org/t")
    (tmp_path / "local-target").mkdir()
    monkeypatch.chdir(tmp_path)
    plan = plan_serving(head, target="local-target", k=7)
    assert (plan.target, plan.k, plan.parallel_drafting) == (str(tmp_path / "local-target"), 7, True)
    argv = api_server_argv(plan, port=8123, extra_args=["--max-model-len", "256"])
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--model") + 1] == str(tmp_path / "local-target")
    assert json.loads(argv[argv.index("--speculative-config") + 1])["num_speculative_tokens"] == 7
    assert argv[-4:] == ["--port", "8123", "--max-model-len", "256"]


def test_refuses_before_starting_vllm(tmp_path):
    with pytest.raises(ValueError, match="not a head directory.*peagle pull"):
        plan_serving(tmp_path)
    unpulled = head_dir(tmp_path / "exported", mask_hidden=True, card_target=TARGET_PLACEHOLDER)
    with pytest.raises(ValueError, match="names no target; pass --target"):
        plan_serving(unpulled)
    with pytest.raises(ValueError, match="at least 1"):
        plan_serving(unpulled, target="org/t", k=0)


def test_the_served_model_is_named_after_the_pulled_card_unless_told(tmp_path):
    head = head_dir(tmp_path / "h", mask_hidden=True, card_target="org/t", card_name="peagle-golden")
    argv = api_server_argv(plan_serving(head))
    assert argv[argv.index("--served-model-name") + 1] == "peagle-golden"
    argv = api_server_argv(plan_serving(head, served_name="my-drafted-model"))
    assert argv[argv.index("--served-model-name") + 1] == "my-drafted-model"


def test_a_card_without_a_name_leaves_the_name_to_vllm(tmp_path):
    argv = api_server_argv(plan_serving(head_dir(tmp_path / "h", mask_hidden=True, card_target="org/t")))
    assert "--served-model-name" not in argv  # vLLM answers to the target's name


@pytest.mark.parametrize("damage", ["truncated weights", "corrupt config"])
@pytest.mark.slow
def test_serve_refuses_a_truncated_or_corrupt_head_naming_the_file(tmp_path, damage):
    from tests.peagle_cli import assert_refused, peagle

    head = head_dir(tmp_path / "h", mask_hidden=True, card_target="org/t")
    if damage == "truncated weights":
        weights = head / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-20])  # a copy or download cut short
        says = f"{weights} is not a readable safetensors file"
    else:
        (head / "config.json").write_text('{"architectures": [')
        says = f"{head / 'config.json'} is not valid JSON"
    assert_refused(peagle("serve", head), says, "The head is truncated or corrupt: pull it again",
                   "or export it again (`peagle export CONFIG`)")
