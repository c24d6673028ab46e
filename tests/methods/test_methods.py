"""Drafting methods: the catalogue's torch-free descriptions, what each method's behaviour answers,
and a new method added here (in the test only) running through training, offline evaluation and
export."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))  # the tiny-run builders
from test_deepspeed import one_thread, tiny_config, tiny_run, tiny_spec  # noqa: E402,F401 (fixtures)

from peagle.catalogue import DESCRIPTIONS, available_methods, describe, trained_methods  # noqa: E402
from peagle.config import ConfigError  # noqa: E402
from peagle.contract import MASK_HIDDEN  # noqa: E402
from peagle.methods import METHODS, get_method  # noqa: E402
from peagle.methods.peagle import PEagle  # noqa: E402


def test_catalogue_names_the_methods_and_refuses_unknown_ones():
    assert available_methods() == ["eagle3", "peagle"] == sorted(METHODS)
    peagle, eagle3 = describe("peagle"), describe("eagle3")
    assert (peagle.label, peagle.display_name, peagle.parallel_drafting) == ("p-eagle", "P-EAGLE", True)
    assert (eagle3.label, eagle3.display_name, eagle3.parallel_drafting) == ("eagle-3", "EAGLE-3", False)
    assert all(get_method(name).description is DESCRIPTIONS[name] for name in METHODS)  # behaviour and description agree
    for lookup in (describe, get_method):
        with pytest.raises(ValueError, match="unknown drafting method 'medusa'; available: eagle3, peagle"):
            lookup("medusa")
    with pytest.raises(ConfigError, match=r"train.method: Value error, unknown drafting method 'medusa'; "
                                          r"available: eagle3, peagle"):
        tiny_config(method="medusa")


def test_each_method_answers_for_itself():
    peagle, eagle3 = get_method("peagle"), get_method("eagle3")
    config = tiny_config(k_train=4, eagle3={"ttt_steps": 2})
    train = config.train
    assert describe("peagle").max_eval_k(train.peagle) == 4 and describe("eagle3").max_eval_k(train.eagle3) is None
    with_depth = tiny_config(k_train=4, eagle3={"ttt_steps": 2, "num_layers": 2})
    assert describe("eagle3").num_layers(with_depth) == 2 and describe("peagle").num_layers(with_depth) == \
        config.drafter.num_layers
    spec = tiny_spec()
    assert set(peagle.head_tensors(spec)) == {MASK_HIDDEN} and eagle3.head_tensors(spec) == {}
    assert describe("eagle3").omitted_tensors == {MASK_HIDDEN} and not describe("peagle").omitted_tensors
    assert peagle.card_training(train, spec) == {"method": "P-EAGLE", "K_train": "4", "COD ratio": "0.8",
                                                 "trained parameters": "all but lm_head (embeddings: the mask row only)"}
    assert eagle3.card_training(train, spec)["TTT steps"] == "2"
    # what EAGLE-3's card says trained follows the drafter: a narrower one trains its table, too
    narrow = replace(spec, hidden_size=spec.target_hidden_size // 2)
    assert eagle3.card_training(train, spec)["trained parameters"] == "all but the embedding table (the target's)"
    assert eagle3.card_training(train, narrow)["trained parameters"].startswith("all (the embedding table too")
    warm = tiny_config(init_from="/heads/previous").train
    assert eagle3.card_training(warm, narrow)["trained parameters"] == "all but the embedding table (the warm start head's)"
    # the EAGLE-3 baseline trains beside a P-EAGLE head, never beside an EAGLE-3 one
    assert trained_methods(tiny_config(baseline={"eagle3": True}).train) == [peagle.description, eagle3.description]
    assert trained_methods(tiny_config(method="eagle3", baseline={"eagle3": True}).train) == [eagle3.description]
    assert trained_methods(train) == [peagle.description]


def test_a_method_names_what_it_has_not_built_yet():
    """A DraftingMethod with only its description trains and drafts nothing, saying which method."""
    from peagle.methods.base import DraftingMethod

    class Bare(DraftingMethod):
        description = replace(describe("peagle"), name="bare", display_name="Bare")

    bare, spec = Bare(), tiny_spec()
    with pytest.raises(NotImplementedError, match="bare: no training objective"):
        bare.objective(tiny_config().train, spec, None)
    with pytest.raises(NotImplementedError, match="bare: no offline drafting"):
        bare.draft(None, None, 3, lambda ids: ids)
    assert bare.head_tensors(spec) == {} and bare.card_training(tiny_config().train, spec) == {"method": "Bare"}
    assert repr(bare) == "<drafting method 'bare'>"


# ----------------------------------------------------------------------------- a new method


class DecayedPEagle(PEagle):
    """P-EAGLE whose loss weighs depth d by GAMMA**d (a depth weighting of its own)."""

    description = replace(describe("peagle"), name="peagle-decay", label="p-eagle-decay",
                          display_name="P-EAGLE (depth decay)")
    GAMMA = 0.5

    def objective(self, train, spec, target_head):
        from peagle.objective.loss import forward_kl, kl_loss

        def loss(model, batch, denominator):
            supervised = batch.supervised
            out = model(input_ids=batch.input_ids, aux_hidden=batch.aux_hidden, position_ids=batch.position_ids,
                        attention_mask=batch.attention_mask, is_mask=batch.is_mask, logits_mask=supervised)
            with torch.no_grad():
                target = target_head(batch.target_hidden[supervised])
            depth = batch.depth[supervised]
            result = kl_loss(out.logits, target, depth, train.peagle.k_train, "uniform", denominator)  # metrics
            weights = self.GAMMA ** depth.float()
            result.loss = (weights * forward_kl(out.logits, target)).sum() / max(float(denominator), 1.0)
            return result

        return replace(super().objective(train, spec, target_head), name=self.name, loss=loss)

    def card_training(self, train, spec):
        return {**super().card_training(train, spec), "depth weight": f"{self.GAMMA}^d"}


@pytest.fixture
def decayed(monkeypatch):
    """The new method's description and behaviour, under its name in the two mappings."""
    method = DecayedPEagle()
    monkeypatch.setitem(DESCRIPTIONS, method.name, method.description)
    monkeypatch.setitem(METHODS, method.name, method)
    return method


def test_a_new_method_trains_evaluates_and_exports(decayed, tiny_run, tmp_path):
    """One new class with its description, nothing else changed: the whole way to a head."""
    from peagle.data.store import ShardReader
    from peagle.data.vocab import VOCAB_FILE, DraftVocab
    from peagle.eval.offline import evaluate_offline
    from peagle.export.head import export_from_checkpoint
    from peagle.export.validate import checked_target_from_spec, static_check
    from peagle.facts import HeadSpec
    from peagle.model import PEagleDrafter
    from peagle.train.trainer import train_drafter

    data_dir, target = tiny_run
    assert decayed.name in available_methods()
    runs = {}
    for method in ("peagle", decayed.name):
        # "uniform": its loss divides by the count; every element charged, as the toy's loss charges them
        cfg = tiny_config(method=method, max_steps=3, depth0_loss_share=None, unaccepted_weight=1.0)
        runs[method] = train_drafter(cfg, data_dir, str(target), tmp_path / method, progress=False)
    plain, toy = runs["peagle"].metrics_history[0], runs[decayed.name].metrics_history[0]
    # the same examples and initial weights (same seed), scored by its own weighting:
    assert toy["kl"] == pytest.approx(plain["kl"], rel=1e-6)  # unweighted KL, the same
    assert decayed.GAMMA ** 2 * plain["loss"] < toy["loss"] < plain["loss"]  # deeper depths count less
    assert runs[decayed.name].metrics_history[-1]["step"] == 3

    checkpoint = runs[decayed.name].last_checkpoint
    spec = HeadSpec.load(checkpoint / "head_spec.json")
    vocab = DraftVocab.load(data_dir / VOCAB_FILE)
    drafter = PEagleDrafter.load(checkpoint / "drafter.safetensors", spec).eval()
    reader = ShardReader(data_dir / "splits" / "train")
    offline = evaluate_offline(drafter, None, reader, spec, vocab, [1, 3], max_samples=4, method=decayed.name,
                               max_k=decayed.description.max_eval_k(decayed.description.own(cfg.train)))
    assert offline.method == decayed.name and offline.num_anchors > 0
    assert 1.0 <= offline.acceptance_length[1] <= offline.acceptance_length[3] <= 4.0

    head = export_from_checkpoint(checkpoint, data_dir, tmp_path / "head", target_path=str(target), method=decayed.name)
    card = (head / "README.md").read_text()
    assert "# P-EAGLE (depth decay) head for" in card and '"parallel_drafting": true' in card
    assert static_check(head, checked_target_from_spec(spec), method=decayed.name).ok
