"""DeepSpeed on CPU: config mapping, ZeRO 0-3 training in this process, two ranks under torchrun.

Also home of the tiny-run builders the other trainer tests import: a random 4-layer
Llama target (hidden 64) saved with ``save_pretrained``, its real hidden states on random
token sequences written through the real shard store, and a 1-layer, hidden-64 drafter.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from pydantic import BaseModel

from peagle.config import parse_config
from peagle.facts import HeadSpec, TargetFacts, head_spec_for
from peagle.layout import DataLayout

VOCAB = 256
HIDDEN = 64
TARGET_LAYERS = 4
DRAFT_VOCAB = 128
MASK_ID = VOCAB - 1
MAX_POSITIONS = 1 << 15  # the long-sequence tests train 16K tokens (+ k_train) on this target


# ----------------------------------------------------------------------------- tiny run builders


def build_tiny_target(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def tiny_facts() -> TargetFacts:
    """What the tiny dataset records about the tiny target."""
    return TargetFacts(
        target="tiny", target_revision=None, target_num_layers=TARGET_LAYERS, target_hidden_size=HIDDEN,
        vocab_size=VOCAB, target_num_heads=4, target_num_kv_heads=2, target_head_dim=16,
        target_intermediate_size=128, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
        max_position_embeddings=MAX_POSITIONS, aux_layer_ids=[1, 2, 3], final_layer_id=TARGET_LAYERS, mask_token_id=MASK_ID,
        draft_vocab_size=DRAFT_VOCAB,
    )


def tiny_spec(**train) -> HeadSpec:
    """The head ``tiny_config(**train)`` trains on the tiny dataset (1 layer, as wide as the target)."""
    return head_spec_for(tiny_config(**train), tiny_facts())


def build_tiny_dataset(data_dir: Path, target: Path, num_samples: int = 16, seed: int = 0, num_eval: int = 0) -> Path:
    """Real target hidden states (layers 1, 2, 3 and the last) of random token sequences.

    ``num_eval`` > 0 also writes an eval split (what offline evaluation reads).
    """
    from transformers import LlamaForCausalLM

    from peagle.data.store import ShardWriter
    from peagle.data.vocab import build_draft_vocab

    model = LlamaForCausalLM.from_pretrained(target).eval()
    spec = tiny_facts()
    data = DataLayout(data_dir)
    generator = torch.Generator().manual_seed(seed)
    # A skewed unigram distribution so a 128-token draft vocabulary covers most targets.
    probs = torch.distributions.Dirichlet(torch.full((VOCAB - 1,), 0.3)).sample()
    counts = torch.zeros(VOCAB, dtype=torch.int64)
    for split, count in (("train", num_samples), ("eval", num_eval)):
        if not count:
            continue
        with ShardWriter(data.split(split), spec.stored_layer_ids, HIDDEN, "float32", 400) as writer:
            for i in range(count):
                n = int(torch.randint(24, 40, (1,), generator=generator))
                tokens = torch.multinomial(probs, n, replacement=True, generator=generator)
                loss_mask = torch.zeros(n, dtype=torch.bool)
                loss_mask[n // 3 :] = True
                with torch.no_grad():
                    states = model(tokens[None], output_hidden_states=True).hidden_states
                hidden = torch.stack([states[k][0] for k in spec.stored_layer_ids], dim=1)
                writer.add(f"{split}{i}" if split == "eval" else f"s{i}", tokens, loss_mask, hidden)
                if split == "train":
                    counts += torch.bincount(tokens[loss_mask], minlength=VOCAB)
    build_draft_vocab(counts, DRAFT_VOCAB).save(data.vocab)
    spec.save(data.facts)
    return data_dir


def train_section(**fields) -> dict:
    """A train section from the tests' short form: a field by its name in its block
    (``world_size=2`` is ``launch.world_size``; every field name belongs to one block), a block
    as a mapping (``eagle3={"ttt_steps": 2}``, ``baseline={"eagle3": True}``), ``method`` and
    ``init_from`` as they are."""
    from peagle.config import TrainConfig

    blocks = {name: field.annotation for name, field in TrainConfig.model_fields.items()
              if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)}
    owner = {f: block for block, model in blocks.items() if block not in ("eagle3", "baseline")
             for f in model.model_fields}
    section: dict = {}
    for key, value in fields.items():
        if key in blocks:
            section.setdefault(key, {}).update(value)
        elif key in owner:
            section.setdefault(owner[key], {})[key] = value
        else:
            section[key] = value
    return section


def tiny_config(drafter_layers: int = 1, **train) -> PipelineConfig:  # noqa: F821
    base = dict(
        k_train=3, cod_ratio=0.8, cod_floor=0.2, max_len=48, epochs=1, micro_batch_size=1,
        learning_rate=3e-3, warmup_ratio=0.1, zero_stage=2, precision="fp32", keep_last=2, seed=0,
        optimizer="adamw",  # exact across ZeRO stages and ranks; tests that need Muon ask for it
    )
    base.update(train)
    # unless a test says otherwise, one micro-batch per rank and step
    base.setdefault("batch_size", base["micro_batch_size"] * base.get("world_size", 1))
    return parse_config(
        {
            "name": "tiny",
            "target": {"model": "embedded"},
            "data": {"sources": [{"kind": "jsonl", "path": "unused.jsonl"}], "max_seq_len": max(64, base["max_len"])},
            "vllm": {"max_model_len": max(1024, 2 * base["max_len"])},
            "drafter": {"num_layers": drafter_layers},
            "train": train_section(**base),
            "eval": {"ks": [k for k in (1, 3) if k <= base["k_train"]]},  # the K a head of k_train is evaluated at
        }
    )


# Two shared cores: a second intra-op thread only spins against the other processes.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def child_env() -> dict:
    """This process's environment for a child that starts its own process group.

    Tests that train in-process made this process rank 0 of a world of one (RANK,
    MASTER_PORT, ... in os.environ); a child must not try to join that rendezvous.
    """
    from peagle.train.launch import DIST_ENV

    return {**{k: v for k, v in os.environ.items() if k not in DIST_ENV}, **ONE_THREAD}


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """(data_dir, target_dir) shared by a test module."""
    root = tmp_path_factory.mktemp("tiny")
    target = build_tiny_target(root / "target")
    return build_tiny_dataset(root / "data", target), target


def read_metrics(out_dir: Path) -> list[dict]:
    lines = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def step_losses(out_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out_dir) if "loss" in r}


# ----------------------------------------------------------------------------- config mapping


def test_deepspeed_config_from_train_config():
    from peagle.train.engine import deepspeed_config

    cfg = tiny_config(zero_stage=3, precision="bf16", offload_optimizer=True, batch_size=8, micro_batch_size=2, segments=2)
    ds = deepspeed_config(cfg.train, world_size=2)
    assert ds["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False}}
    assert ds["bf16"] == {"enabled": True}
    assert ds["optimizer"]["type"] == "AdamW" and ds["optimizer"]["params"]["torch_adam"] is True
    # Every segment of every micro-batch is one DeepSpeed micro-step.
    assert ds["gradient_accumulation_steps"] == 8
    assert ds["train_batch_size"] == 2 * 8 * 2
    assert ds["gradient_clipping"] == cfg.train.recipe.grad_clip
    with pytest.raises(ValueError, match="offload_optimizer needs"):
        deepspeed_config(tiny_config(zero_stage=0, offload_optimizer=True).train, world_size=1)


def test_warmup_then_linear_decay():
    from peagle.train.engine import warmup_decay

    factor = warmup_decay(total_steps=10, warmup=2)
    assert [round(factor(s), 4) for s in range(10)] == [0.5, 1.0, 1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125]


# ----------------------------------------------------------------------------- training in this process


def test_zero2_single_process_loss_falls(tiny_run, tmp_path):
    from peagle.train.trainer import train_drafter

    data_dir, target = tiny_run
    cfg = tiny_config(zero_stage=2, max_steps=40, batch_size=2, warmup_ratio=0.05)
    start = time.perf_counter()
    result = train_drafter(cfg, data_dir, str(target), tmp_path / "out", progress=False)
    elapsed = time.perf_counter() - start
    losses = [r["loss"] for r in result.metrics_history if "loss" in r]
    assert len(losses) == 40
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.7 * first, f"loss did not fall: first steps {losses[:4]}, last {losses[-4:]}"
    assert result.last_checkpoint is not None and result.last_checkpoint.name == "step-000040"
    assert result.best_checkpoint is None  # nothing was evaluated
    step_times = [r["step_time_s"] for r in result.metrics_history[5:]]
    print(f"\ntiny ZeRO-2 step (2 micro-batches): {1000 * sorted(step_times)[len(step_times) // 2]:.1f} ms median, "
          f"{elapsed:.1f} s for 40 steps incl. init; {result.metrics_history[-1]['tokens_per_s']:.0f} tokens/s")
    assert {"lr", "acc/depth_0", "acc/depth_2", "tokens_per_s", "grad_norm"} <= set(result.metrics_history[-1])


@pytest.fixture(scope="module")
def zero2_reference(tiny_run, tmp_path_factory):
    """Loss trajectory of 4 ZeRO-2 fp32 steps: every other stage must reproduce it."""
    from peagle.train.trainer import train_drafter

    data_dir, target = tiny_run
    out = tmp_path_factory.mktemp("zero2-ref")
    result = train_drafter(tiny_config(max_steps=4, zero_stage=2), data_dir, str(target), out, progress=False)
    return [r["loss"] for r in result.metrics_history]


@pytest.mark.parametrize(
    "train, tolerance",
    [
        ({"zero_stage": 1}, 1e-5),
        ({"zero_stage": 3}, 1e-5),
        ({"zero_stage": 2, "offload_optimizer": True}, 1e-5),
        ({"zero_stage": 0, "precision": "bf16"}, 5e-2),
    ],
    ids=["zero1", "zero3", "zero2-offload", "zero0-bf16"],
)
def test_other_zero_stages_match_zero2(tiny_run, tmp_path, zero2_reference, train, tolerance):
    from safetensors.torch import load_file

    from peagle.model import PEagleDrafter
    from peagle.train.trainer import train_drafter

    data_dir, target = tiny_run
    result = train_drafter(tiny_config(max_steps=4, **train), data_dir, str(target), tmp_path / "out", progress=False)
    losses = [r["loss"] for r in result.metrics_history]
    assert losses == pytest.approx(zero2_reference, rel=tolerance, abs=tolerance)
    state = load_file(str(result.last_checkpoint / "drafter.safetensors"))
    drafter = PEagleDrafter.from_checkpoint(result.last_checkpoint)
    assert drafter.spec == tiny_spec(max_steps=4, **train)  # the checkpoint records the head it holds
    assert set(state) == set(drafter.state_dict())
    assert all(v.numel() > 0 for v in state.values())  # ZeRO-3 partitions were gathered


# ----------------------------------------------------------------------------- two ranks


@pytest.mark.slow  # torchrun with two DeepSpeed ranks: ~30 s on 2 cores
def test_two_ranks_under_torchrun_agree(tiny_run, tmp_path):
    from peagle.checkpoint_format import read_trainer_state
    from peagle.train.launch import launch_training

    data_dir, target = tiny_run
    cfg = tiny_config(world_size=2, zero_stage=2, max_steps=4, save_every=2)
    result = launch_training(cfg, data_dir, str(target), tmp_path / "out", progress=False, env=ONE_THREAD)
    assert [r["step"] for r in result.metrics_history] == [1, 2, 3, 4]
    state = read_trainer_state(result.last_checkpoint)
    assert state.world_size == 2 and len(state.replica_checksums) == 2
    assert state.replica_checksums[0] == state.replica_checksums[1]
    engine_dir = result.last_checkpoint / "deepspeed" / "engine"
    assert sorted(p.name for p in engine_dir.glob("*optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    assert (result.last_checkpoint / "rng-rank-1.json").exists()
