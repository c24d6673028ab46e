"""Checkpoints: RNG as JSON, keep-last-N plus best-by-acceptance, safe DeepSpeed loading, atomic writes."""

from __future__ import annotations

import json
import pickle
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the tiny-run builders live in test_deepspeed.py
from safetensors.torch import load_file
from test_deepspeed import child_env, one_thread, read_metrics, tiny_config, tiny_run  # noqa: F401 (fixtures)

from peagle import checkpoint_format as fmt
from peagle.fileio import temp_sibling
from peagle.train import checkpoint as ckpt


def test_rng_states_round_trip_through_json():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = json.loads(json.dumps(ckpt.capture_rng()))  # plain lists, no pickle
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    ckpt.restore_rng(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_keeps_last_n_plus_best_by_acceptance(tiny_run, tmp_path):
    from peagle.train.trainer import train_drafter

    data_dir, target = tiny_run
    acceptances = iter([1.0, 3.0, 2.0, 1.5, 1.2])  # peaks at step 2, while the loss keeps falling
    seen = []
    out = tmp_path / "out"
    result = train_drafter(
        tiny_config(max_steps=5, eval_every=1, keep_last=2), data_dir, str(target), out,
        progress=False, eval_fn=lambda drafter: next(acceptances), on_metrics=lambda step, rec: seen.append(step),
    )
    assert [p.name for p in fmt.list_checkpoints(out)] == ["step-000002", "step-000004", "step-000005"]
    assert result.best_checkpoint == out / "step-000002" == fmt.best_checkpoint(out)
    assert result.last_checkpoint == out / "step-000005" == fmt.latest_checkpoint(out)
    assert fmt.read_trainer_state(result.best_checkpoint).acceptance == 3.0
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]
    stale = temp_sibling(out / "step-000003", "old")  # a publish killed between its two renames
    stale.mkdir()
    ckpt.prune_checkpoints(out, keep_last=2)
    assert not stale.exists() and [p.name for p in fmt.list_checkpoints(out)][-1] == "step-000005"
    evals = [r["eval/acceptance"] for r in read_metrics(out) if "eval/acceptance" in r]
    assert evals == [1.0, 3.0, 2.0, 1.5, 1.2]
    assert seen == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]  # each step's record, then its evaluation
    for name in ("drafter.safetensors", "head_spec.json", "trainer_state.json", "deepspeed/engine"):
        assert (result.best_checkpoint / name).exists()
    for kept in fmt.list_checkpoints(out):  # every checkpoint says which head it holds
        spec = fmt.read_head_spec(kept)
        assert (spec.num_layers, spec.method, spec.k_train, spec.draft_vocab_size) == (1, "peagle", 3, 128)


def _one_step(engine, objective, batch):
    from peagle.train.trainer import StepStats, run_micro_batch

    run_micro_batch(engine, objective, batch, segments=1, grad_accum=1, stats=StepStats(3, engine.device))


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.slow
def test_engine_state_resumes_exactly_without_unpickling(tiny_run, tmp_path, optimizer):
    from peagle.model import PEagleDrafter
    from peagle.objective.loss import TargetHead
    from peagle.train.data import EpochSamples
    from peagle.train.engine import build_engine, init_process_group
    from peagle.train.trainer import load_training_inputs, make_objective

    data_dir, target = tiny_run
    init_process_group()
    cfg = tiny_config(zero_stage=2, optimizer=optimizer)
    inputs = load_training_inputs(data_dir, cfg)
    objective = make_objective(cfg.train, inputs.spec, TargetHead.from_target(str(target), inputs.spec, inputs.draft_ids))
    samples = EpochSamples(inputs.samples, objective.make_example, seed=0)
    batches = [[samples[i][0]] for i in range(3)]  # micro-batches: lists of examples

    def fresh_engine(seed):
        torch.manual_seed(seed)
        return build_engine(PEagleDrafter(inputs.spec), cfg.train, total_steps=10, world_size=1)

    trained = fresh_engine(0)
    _one_step(trained, objective, batches[0])
    _one_step(trained, objective, batches[1])
    state = fmt.TrainerState(step=2, epoch=0, epoch_position=2, world_size=1, steps_per_epoch=16,
                              micro_batch_size=1, grad_accum=1, total_steps=10)
    path = ckpt.save_checkpoint(trained, inputs.spec, state, tmp_path, keep_last=2)

    # DeepSpeed's optimizer file holds pickled DeepSpeed objects: a plain weights-only load
    # refuses it, DeepSpeed's stock loader would unpickle it, ours allow-lists three classes.
    optim_file = next((path / "deepspeed" / "engine").glob("*optim_states.pt"))
    with pytest.raises(pickle.UnpicklingError):
        torch.load(optim_file, weights_only=True)

    resumed = fresh_engine(1)
    assert ckpt.load_checkpoint(resumed, path).step == 2
    assert resumed.global_steps == 2 and resumed.lr_scheduler.get_last_lr() == trained.lr_scheduler.get_last_lr()
    # The world-size-free copy (what a resume at another world size rebuilds from) holds each
    # parameter's own optimizer state: Muon's momentum for the matrices it trains.
    consolidated = load_file(str(path / ckpt.OPTIMIZER_FILE))
    by_muon = {name: bool(getattr(p, "use_muon", False)) for name, p in trained.module.named_parameters()
               if p.requires_grad}
    assert any(by_muon.values()) == (optimizer == "muon")
    for name, muon in by_muon.items():
        for key in ckpt.state_keys(muon):
            assert consolidated[f"{key}/{name}"].abs().sum() > 0, f"{key}/{name} was saved empty"
    rebuilt = fresh_engine(2)
    ckpt.load_consolidated(rebuilt, path, written_by=1)
    for engine in (trained, resumed, rebuilt):
        _one_step(engine, objective, batches[2])
    for (name, a), b, c in zip(trained.module.named_parameters(), resumed.module.parameters(),
                               rebuilt.module.parameters()):
        assert torch.equal(a, b), f"{name} differs after resuming: optimizer state was not restored"
        assert torch.allclose(a, c, atol=1e-6), f"{name} differs after a rebuild from {ckpt.OPTIMIZER_FILE}"


@pytest.mark.slow
def test_a_checkpoint_resumes_at_another_zero_stage(tiny_run, tmp_path):
    """train.launch is no part of a head: a ZeRO-2 checkpoint resumes under ZeRO-1 and ZeRO-0,
    rebuilt from its world-size-free optimizer.safetensors, and steps on as the ZeRO-2 run does."""
    from peagle.model import PEagleDrafter
    from peagle.objective.loss import TargetHead
    from peagle.train.data import EpochSamples
    from peagle.train.engine import build_engine, init_process_group
    from peagle.train.trainer import load_training_inputs, make_objective

    data_dir, target = tiny_run
    init_process_group()
    inputs = load_training_inputs(data_dir, tiny_config())
    objective = make_objective(tiny_config().train, inputs.spec,
                               TargetHead.from_target(str(target), inputs.spec, inputs.draft_ids))
    samples = EpochSamples(inputs.samples, objective.make_example, seed=0)
    batches = [[samples[i][0]] for i in range(3)]

    def engine_at(stage: int, seed: int):
        torch.manual_seed(seed)
        return build_engine(PEagleDrafter(inputs.spec), tiny_config(zero_stage=stage).train, total_steps=10, world_size=1)

    trained = engine_at(2, 0)
    _one_step(trained, objective, batches[0])
    _one_step(trained, objective, batches[1])
    state = fmt.TrainerState(step=2, epoch=0, epoch_position=2, world_size=1, steps_per_epoch=16,
                              micro_batch_size=1, grad_accum=1, total_steps=10, zero_stage=2)
    path = ckpt.save_checkpoint(trained, inputs.spec, state, tmp_path, keep_last=2)
    resumed = {stage: engine_at(stage, stage + 1) for stage in (1, 0)}
    for engine in resumed.values():
        assert ckpt.load_checkpoint(engine, path).step == 2
    for engine in (trained, *resumed.values()):
        _one_step(engine, objective, batches[2])
    for stage, engine in resumed.items():
        for (name, a), b in zip(trained.module.named_parameters(), engine.module.parameters()):
            assert torch.allclose(a, b, atol=1e-6), f"{name} differs after resuming a ZeRO-2 checkpoint at ZeRO-{stage}"


def test_muon_steps_the_decoder_matrices_by_orthogonal_updates(tiny_run):
    """train.recipe.optimizer: muon trains fc, attention and MLP with Muon (an update's largest singular
    values all about the learning rate, what no gradient step gives) and the rest with AdamW."""
    from peagle.model import PEagleDrafter
    from peagle.objective.loss import TargetHead
    from peagle.train.data import EpochSamples
    from peagle.train.engine import build_engine, init_process_group
    from peagle.train.trainer import load_training_inputs, make_objective

    data_dir, target = tiny_run
    init_process_group()
    cfg = tiny_config(optimizer="muon", warmup_ratio=0.0)
    inputs = load_training_inputs(data_dir, cfg)
    objective = make_objective(cfg.train, inputs.spec, TargetHead.from_target(str(target), inputs.spec, inputs.draft_ids))
    sample = EpochSamples(inputs.samples, objective.make_example, seed=0)[0][0]
    torch.manual_seed(0)
    engine = build_engine(PEagleDrafter(inputs.spec), cfg.train, total_steps=10, world_size=1)
    before = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    _one_step(engine, objective, [sample])
    muon = {name for name, p in engine.module.named_parameters() if getattr(p, "use_muon", False)}
    assert {"fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"} <= muon
    assert not muon & {"embed_tokens.weight", "lm_head.weight", "norm.weight"}
    lr = cfg.train.recipe.muon_learning_rate
    for name, p in engine.module.named_parameters():
        if name in muon and p.dim() == 2:
            rows, cols = p.shape
            singular = torch.linalg.svdvals((p.detach() - before[name]).double())
            # Muon's step: the orthogonalized momentum (Newton-Schulz puts its singular values
            # near 1) times the lr and sqrt(max(1, rows / cols)). Clipped, it was a tenth of that.
            top = singular[:4] / (lr * max(1.0, rows / cols) ** 0.5)
            assert 0.6 < top.min() and top.max() < 1.5, f"{name}: not a Muon step of size lr ({top})"
    # mask_hidden (h_shared) is AdamW's: its first step moves each element by about the AdamW
    # lr (sign of the gradient), where Muon's would be one unit-norm row times muon_lr.
    assert "mask_hidden" not in muon
    step = (engine.module.mask_hidden.detach() - before["mask_hidden"]).abs()
    moved = step[step > 0]
    assert moved.numel() > 0.9 * step.numel(), "AdamW moves every element of mask_hidden"
    assert torch.allclose(moved.median(), torch.tensor(cfg.train.recipe.learning_rate), rtol=0.2), \
        f"mask_hidden's step {moved.median():.2e} is not AdamW's lr {cfg.train.recipe.learning_rate:.2e}"


CHILD_SAVE = r"""
import sys, time, torch
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from test_deepspeed import tiny_config, tiny_spec
from peagle.model import PEagleDrafter
from peagle.fileio import temp_sibling
from peagle import checkpoint_format as fmt
from peagle.train import checkpoint as ckpt
from peagle.train.engine import build_engine, init_process_group

root, marker = Path(sys.argv[2]), Path(sys.argv[3])
init_process_group()
engine = build_engine(PEagleDrafter(tiny_spec()), tiny_config().train, total_steps=10, world_size=1)

def state(step):
    return fmt.TrainerState(step=step, epoch=0, epoch_position=step, world_size=1, steps_per_epoch=16,
                             micro_batch_size=1, grad_accum=1, total_steps=10)

ckpt.save_checkpoint(engine, tiny_spec(), state(1), root, keep_last=2)
real_save = ckpt.save_file

def save_then_stall(tensors, path, metadata=None):  # the write completes, then the process is killed mid-checkpoint
    real_save(tensors, path, metadata)
    marker.touch()
    time.sleep(300)

ckpt.save_file = save_then_stall
ckpt.save_checkpoint(engine, tiny_spec(), state(2), root, keep_last=2)
"""


@pytest.mark.slow
def test_killed_write_leaves_no_visible_partial_checkpoint(tmp_path):
    root, marker = tmp_path / "ckpts", tmp_path / "writing"
    script = tmp_path / "child.py"
    script.write_text(CHILD_SAVE)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(Path(__file__).parent), str(root), str(marker)],
        env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    deadline = time.time() + 240
    while not marker.exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.time() < deadline, "the child never reached the second checkpoint"
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    partial = root / ".tmp-step-000002"
    assert (partial / "drafter.safetensors").exists()  # the half-written checkpoint is on disk...
    assert fmt.list_checkpoints(root) == [root / "step-000001"]  # ...but never listed
    assert fmt.latest_checkpoint(root) == root / "step-000001"
    assert fmt.read_trainer_state(fmt.latest_checkpoint(root)).step == 1
    ckpt.prune_checkpoints(root, keep_last=2)  # what the next save does afterwards
    assert not partial.exists() and (root / "step-000001").exists()
