"""P-EAGLE's recipe holds in a real DeepSpeed run: what is frozen stays the target's, the mask
row and mask_hidden learn, and the recipe's fields are validated and owned by P-EAGLE."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the tiny-run builders live in test_deepspeed.py
from test_deepspeed import MASK_ID, one_thread, read_metrics, tiny_config, tiny_run, tiny_spec  # noqa: F401 (fixtures)

from peagle.config import ConfigError
from peagle.data.vocab import DraftVocab
from peagle.layout import DataLayout
from peagle.model import PEagleDrafter
from peagle.model.target_weights import load_target_tensors


def trained_steps(tiny_run, out: Path, **train) -> tuple[dict, dict, dict]:
    """(step 1 weights, step 3 weights, the target's embed/lm_head rows) of a 3-step run."""
    from peagle.train.trainer import train_drafter

    data_dir, target = tiny_run
    cfg = tiny_config(max_steps=3, save_every=1, keep_last=5, learning_rate=1e-2, **train)
    train_drafter(cfg, data_dir, str(target), out, progress=False)
    first, last = (PEagleDrafter.from_checkpoint(out / f"step-00000{s}").state_dict() for s in (1, 3))
    draft_ids = DraftVocab.load(DataLayout(data_dir).vocab).draft_ids
    return first, last, load_target_tensors(target, draft_ids)


def test_frozen_weights_stay_the_targets_and_the_mask_row_learns(tiny_run, tmp_path):
    # Every element charged: the tiny random target's next-token drafts all miss in 3 steps, so
    # under the default (train.recipe.unaccepted_weight 0) no mask slot would be charged at all.
    first, last, target = trained_steps(tiny_run, tmp_path / "recipe", freeze_lm_head=True,
                                        train_embeddings="mask_row", mask_hidden_init_std=1.0, unaccepted_weight=1.0)
    assert torch.equal(last["lm_head.weight"], target["lm_head"])  # bit for bit, after 3 AdamW steps
    others = torch.arange(last["embed_tokens.weight"].shape[0]) != MASK_ID
    assert torch.equal(last["embed_tokens.weight"][others], target["embed_tokens"][others])
    assert not torch.equal(last["embed_tokens.weight"][MASK_ID], first["embed_tokens.weight"][MASK_ID])
    assert not torch.equal(last["mask_hidden"], first["mask_hidden"])
    assert not torch.equal(last["fc.weight"], first["fc.weight"])
    assert 0.5 < float(first["mask_hidden"].std()) < 2.0  # drawn at std 1 (3 x 64 values), then a few steps


def test_without_freezing_lm_head_and_embeddings_train(tiny_run, tmp_path):
    """The same run with every parameter trainable moves them: the test above can fail."""
    _, last, target = trained_steps(tiny_run, tmp_path / "all", freeze_lm_head=False, train_embeddings="all")
    assert not torch.equal(last["lm_head.weight"], target["lm_head"])
    others = torch.arange(last["embed_tokens.weight"].shape[0]) != MASK_ID
    assert not torch.equal(last["embed_tokens.weight"][others], target["embed_tokens"][others])


def test_eagle3_keeps_the_targets_embedding_table_and_trains_lm_head(tiny_run, tmp_path):
    """EAGLE-3's baseline trains as its reference trainers do: the table frozen, lm_head learning."""
    first, last, target = trained_steps(tiny_run, tmp_path / "eagle3", method="eagle3", eagle3={"ttt_steps": 3})
    assert torch.equal(last["embed_tokens.weight"], first["embed_tokens.weight"])
    others = torch.arange(last["embed_tokens.weight"].shape[0]) != MASK_ID
    assert torch.equal(last["embed_tokens.weight"][others], target["embed_tokens"][others])
    assert not torch.equal(last["lm_head.weight"], first["lm_head.weight"])
    assert not torch.equal(last["fc.weight"], first["fc.weight"])


def test_frozen_embedding_rows_are_kept_from_weight_decay():
    from peagle.train.engine import parameter_groups

    drafter = PEagleDrafter(tiny_spec())
    drafter.lm_head.requires_grad_(False)
    drafter.train_mask_row_only()
    decay, no_decay = parameter_groups(drafter, weight_decay=0.1)
    assert any(p is drafter.mask_embedding for p in no_decay["params"])
    assert not any(p is drafter.embed_tokens.weight for g in (decay, no_decay) for p in g["params"])
    assert not any(p is drafter.lm_head.weight for g in (decay, no_decay) for p in g["params"])


def test_recipe_fields_are_validated():
    with pytest.raises(ConfigError, match="train.peagle.train_embeddings"):
        tiny_config(train_embeddings="none")
    with pytest.raises(ConfigError, match="train.peagle.mask_hidden_init_std"):
        tiny_config(mask_hidden_init_std=0)
    with pytest.raises(ConfigError, match="train.peagle.freeze_lm_head"):
        tiny_config(freeze_lm_head="sometimes")


def test_freezing_a_drafter_narrower_than_its_target_names_the_fix():
    from peagle.methods import get_method

    cfg = tiny_config(freeze_lm_head=True, train_embeddings="mask_row")
    narrow = replace(tiny_spec(), hidden_size=32, head_dim=8)  # random lm_head / embeddings: nothing to keep
    with pytest.raises(ValueError, match="train.peagle.freeze_lm_head: false"):
        get_method("peagle").prepare_drafter(PEagleDrafter(narrow), cfg.train)
    trains_all = tiny_config(freeze_lm_head=False, train_embeddings="all").train
    get_method("peagle").prepare_drafter(PEagleDrafter(narrow), trains_all)


def test_the_recipe_is_p_eagles_own():
    """EAGLE-3's head identity ignores P-EAGLE's recipe fields; P-EAGLE's changes with them."""
    from peagle.identity import training_hash

    a, b = tiny_config(freeze_lm_head=False), tiny_config(freeze_lm_head=True)
    assert training_hash(a, "eagle3") == training_hash(b, "eagle3")
    assert training_hash(a, "peagle") != training_hash(b, "peagle")


def test_depth0_share_is_the_default_weighting_and_yields_to_an_explicit_one():
    from peagle.methods import get_method
    from peagle.objective.loss import Depth0Share

    peagle = get_method("peagle")
    assert peagle.objective(tiny_config().train, tiny_spec(), None).weighting == Depth0Share(0.5)
    assert peagle.objective(tiny_config(depth0_loss_share=None).train, tiny_spec(), None).weighting == "uniform"
    chosen = tiny_config(loss_depth_weighting="per_depth_mean").train
    assert peagle.objective(chosen, tiny_spec(), None).weighting == "per_depth_mean"
    with pytest.raises(ConfigError, match="train.peagle.depth0_loss_share"):
        tiny_config(depth0_loss_share=1.0)


def test_max_samples_trains_on_the_first_answers_and_names_a_split_too_small(tiny_run, tmp_path):
    from peagle.train.trainer import train_drafter

    data_dir, target = tiny_run
    train_drafter(tiny_config(max_samples=3, epochs=2), data_dir, str(target), tmp_path / "three", progress=False)
    steps = [r["step"] for r in read_metrics(tmp_path / "three") if "loss" in r]
    assert steps[-1] == 6  # 3 answers, one a step, twice
    with pytest.raises(ValueError, match=r"train.recipe.max_samples is 999 but the train split holds 16 answers"):
        train_drafter(tiny_config(max_samples=999), data_dir, str(target), tmp_path / "many", progress=False)


def test_a_true_previous_head_trains_records_it_and_is_refused_export(tiny_run, tmp_path):
    """The upper-bound measurement trains and is evaluated like any head, but vLLM feeds mask
    tokens: export refuses it by name, and a run that would serve or compare it online is refused."""
    from peagle.export.head import ExportError, export_from_checkpoint
    from peagle.facts import HeadSpec
    from peagle.train.trainer import train_drafter

    data_dir, target = tiny_run
    cfg = tiny_config(max_steps=2, mask_slot_inputs="true_previous")
    train_drafter(cfg, data_dir, str(target), tmp_path / "oracle", progress=False)
    ckpt = tmp_path / "oracle" / "step-000002"
    assert HeadSpec.load(ckpt / "head_spec.json").mask_slot_inputs == "true_previous"
    with pytest.raises(ExportError, match="train.peagle.mask_slot_inputs: true_previous"):
        export_from_checkpoint(ckpt, data_dir, tmp_path / "head", target_path=str(target))
    with pytest.raises(ConfigError, match="cannot be served"):
        tiny_config(mask_slot_inputs="true_previous", baseline={"eagle3": True})
    with pytest.raises(ConfigError, match="cannot be served"):
        tiny_config(mask_slot_inputs="true_previous", method="eagle3")
