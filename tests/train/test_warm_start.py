"""Warm start from an exported head: weights carried over, the draft vocabulary remapped."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from test_deepspeed import DRAFT_VOCAB, VOCAB, one_thread, tiny_config, tiny_run, tiny_spec  # noqa: F401 (fixtures)

from peagle.export.head import VocabMaps, head_tensors
from peagle.model import PEagleDrafter
from peagle.train.warm_start import lm_head_row_sources, warm_start


def vocab_maps(draft_ids: torch.Tensor) -> VocabMaps:
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[draft_ids] = True
    return VocabMaps(draft_ids, draft_ids - torch.arange(draft_ids.numel()), t2d)


def export_tensors(drafter: PEagleDrafter, head_dir: Path, draft_ids: torch.Tensor, method: str = "peagle") -> Path:
    """What ``peagle export`` writes for this drafter's weights (vLLM's names, d2t, t2d)."""
    head_dir.mkdir(parents=True, exist_ok=True)
    tensors = head_tensors(drafter.state_dict(), drafter.spec, vocab_maps(draft_ids), torch.float32, method=method)
    save_file(tensors, str(head_dir / "model.safetensors"))
    return head_dir


def random_drafter(seed: int, spec=None) -> PEagleDrafter:
    torch.manual_seed(seed)
    drafter = PEagleDrafter(spec or tiny_spec())
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0.0, 0.1)
    return drafter


def test_row_sources_find_shared_tokens():
    old, new = torch.tensor([2, 5, 9, 11]), torch.tensor([1, 5, 11, 12])
    assert lm_head_row_sources(old, new).tolist() == [-1, 1, 3, -1]


def test_weights_copied_and_lm_head_rows_follow_their_tokens(tmp_path):
    old_ids = torch.arange(0, 2 * DRAFT_VOCAB, 2)  # even target ids
    new_ids = torch.arange(DRAFT_VOCAB // 2, DRAFT_VOCAB // 2 + DRAFT_VOCAB)  # the vocabulary moved
    old = random_drafter(0)
    head = export_tensors(old, tmp_path / "head", old_ids)
    fresh = random_drafter(1)
    before = fresh.lm_head.weight.detach().clone()

    report = warm_start(fresh, head, new_ids)

    for name, value in old.state_dict().items():
        if name != "lm_head.weight":
            assert torch.equal(fresh.state_dict()[name], value), name
    source = {int(t): i for i, t in enumerate(old_ids)}
    for row, token in enumerate(new_ids.tolist()):
        want = old.lm_head.weight[source[token]] if token in source else before[row]
        assert torch.equal(fresh.lm_head.weight[row], want), (row, token)
    shared = len(set(old_ids.tolist()) & set(new_ids.tolist()))
    assert (report.lm_head_rows_copied, report.lm_head_rows_new) == (shared, DRAFT_VOCAB - shared)
    assert 0 < shared < DRAFT_VOCAB


def test_an_eagle3_head_seeds_a_peagle_drafter_and_mask_hidden_stays_initialised(tmp_path):
    """Staged training: an EAGLE-3 head (no mask_hidden) warm starts the parallel drafter."""
    ids = torch.arange(DRAFT_VOCAB)
    old = random_drafter(0)
    head = export_tensors(old, tmp_path / "head", ids, method="eagle3")
    fresh = random_drafter(1)
    mask_hidden = fresh.mask_hidden.detach().clone()

    report = warm_start(fresh, head, ids)

    assert report.kept_fresh == ["mask_hidden"]
    assert torch.equal(fresh.mask_hidden, mask_hidden) and not torch.equal(mask_hidden, old.mask_hidden)
    for name, value in old.state_dict().items():
        if name != "mask_hidden":
            assert torch.equal(fresh.state_dict()[name], value), name
    assert warm_start(random_drafter(2), export_tensors(old, tmp_path / "p", ids), ids).kept_fresh == []


def test_another_architecture_is_refused_by_name(tmp_path):
    deeper = dataclasses.replace(tiny_spec(), num_layers=2)
    head = export_tensors(random_drafter(0, deeper), tmp_path / "head", torch.arange(DRAFT_VOCAB))
    with pytest.raises(ValueError, match=r"another architecture.*layers\.1"):
        warm_start(random_drafter(1), head, torch.arange(DRAFT_VOCAB))
    with pytest.raises(FileNotFoundError, match="exported head directory"):
        warm_start(random_drafter(1), tmp_path / "nowhere", torch.arange(DRAFT_VOCAB))


def test_a_head_of_another_depth_names_the_config_key(tmp_path):
    """With the head's config.json, the refusal names the drafter key to set (before any tensor is read)."""
    import json

    from peagle.contract import head_config

    deeper = dataclasses.replace(tiny_spec(), num_layers=2)
    head = export_tensors(random_drafter(0, deeper), tmp_path / "head", torch.arange(DRAFT_VOCAB))
    (head / "config.json").write_text(json.dumps(head_config(deeper, "float32")))
    with pytest.raises(ValueError, match=r"num_hidden_layers 2 \(head\) vs 1 \(now\).*set drafter\.num_layers: 2"):
        warm_start(random_drafter(1), head, torch.arange(DRAFT_VOCAB))


def test_training_starts_where_the_head_left_off(tiny_run, tmp_path):
    """A warm-started run's first loss is the trained head's, far below a cold start's."""
    from peagle.data.vocab import VOCAB_FILE, DraftVocab
    from peagle.train.trainer import train_drafter

    data_dir, target = tiny_run
    # Every weight trains: on this random target 16 steps of the frozen-lm_head recipe move the loss too little.
    recipe = {"freeze_lm_head": False, "train_embeddings": "all"}
    cold = train_drafter(tiny_config(max_steps=16, **recipe), data_dir, str(target), tmp_path / "cold", progress=False)
    trained = PEagleDrafter.from_checkpoint(cold.last_checkpoint)
    head = export_tensors(trained, tmp_path / "head", DraftVocab.load(data_dir / VOCAB_FILE).draft_ids)

    warm = train_drafter(tiny_config(max_steps=1, init_from=str(head), **recipe), data_dir, str(target),
                         tmp_path / "warm", progress=False)
    assert warm.warm_start == {"head_dir": str(head), "lm_head_rows_copied": DRAFT_VOCAB, "lm_head_rows_new": 0,
                               "kept_fresh": []}
    first_cold, last_cold = cold.metrics_history[0]["loss"], cold.metrics_history[-1]["loss"]
    assert last_cold < 0.8 * first_cold  # the cold run learned something to carry over
    assert warm.metrics_history[0]["loss"] < 0.8 * first_cold
    with pytest.raises(ValueError, match="resolved by the pipeline"):
        train_drafter(tiny_config(max_steps=1, init_from="champion"), data_dir, str(target), tmp_path / "c")
