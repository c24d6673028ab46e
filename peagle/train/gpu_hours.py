"""What a GPU config's training costs in GPU hours, from the trainer's throughput measured on a GPU.

``bench/gpu_smoke.py`` times one optimizer step of the trainer on one GPU for a drafter of
Llama-3.1-8B's shape (``MEASURED``). The plan (``peagle config check``) multiplies out:
epochs x the train split's tokens / tokens per second a GPU. Its token count is the data plan's
upper bound (every sample at ``data.max_seq_len``), so the hours are one too.

A drafter of another width is projected from the measured one by its matrices' parameters
(a token's matrix work scales with them; flex attention's sparse work does not, so the
projection errs for drafters much narrower than the measured one). A config whose step differs
in what the rate depends on beyond the drafter's size (method, K_train, COD ratio, sequence
length and segments, attention backend, optimizer) gets no estimate: the line names what was
measured. Ranks are counted as scaling linearly, which no run past one GPU has measured yet.
"""

from __future__ import annotations

from dataclasses import dataclass

from peagle.config import PipelineConfig
from peagle.facts import DrafterShape, TargetFacts, drafter_shape


@dataclass(frozen=True)
class MeasuredRate:
    """One training step's tokens per second on one GPU, and the step it was measured for."""

    gpu: str
    method: str
    k_train: int
    cod_ratio: float
    max_len: int
    segments: int
    attention: str  # the backend the step ran ("auto" picks flex on CUDA)
    optimizer: str
    matrix_params: int  # the measured drafter's (``matrix_params``)
    tokens_per_s: float
    source: str  # the result file that holds it


LLAMA_8B_SHAPE = DrafterShape(hidden_size=4096, num_layers=4, num_heads=32, num_kv_heads=8, head_dim=128,
                              intermediate_size=14336, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None,
                              max_position_embeddings=131072)
MEASURED_SOURCE = "bench/results/h200/gpu_smoke_muon.md"  # AdamW and Muon in one lease, one after the other


def matrix_params(shape: DrafterShape, target_hidden: int, aux_layers: int, draft_vocab: int) -> int:
    """The parameters of the drafter's matrices a token's elements pass through: the fc that
    fuses the target's layers, each decoder layer's attention and MLP, and the lm head."""
    attention = shape.hidden_size * shape.head_dim * (2 * shape.num_heads + 2 * shape.num_kv_heads)
    mlp = 3 * shape.hidden_size * shape.intermediate_size
    return (aux_layers * target_hidden * shape.hidden_size + shape.num_layers * (attention + mlp)
            + shape.hidden_size * draft_vocab)


def _measured(optimizer: str, tokens_per_s: float) -> MeasuredRate:
    return MeasuredRate(gpu="H200", method="peagle", k_train=8, cod_ratio=0.8, max_len=8192, segments=2,
                        attention="flex", optimizer=optimizer,
                        matrix_params=matrix_params(LLAMA_8B_SHAPE, 4096, 3, 32000), tokens_per_s=tokens_per_s,
                        source=MEASURED_SOURCE)


MEASURED = (_measured("adamw", 7487.0), _measured("muon", 7593.0))


def measured_rate(cfg: PipelineConfig) -> MeasuredRate | None:
    """The measured step this config's training takes (all but the drafter's size alike), or None."""
    t = cfg.train
    for rate in MEASURED:
        if ((t.method, t.peagle.k_train, t.peagle.cod_ratio, t.recipe.max_len, t.recipe.segments, t.recipe.optimizer)
                == (rate.method, rate.k_train, rate.cod_ratio, rate.max_len, rate.segments, rate.optimizer)
                and t.launch.attention in ("auto", rate.attention)):
            return rate
    return None


def gpu_hours_line(cfg: PipelineConfig, facts: TargetFacts, train_tokens: int | None) -> str:
    """The plan's line on training's GPU hours (a GPU config: ``train.recipe.precision: bf16``), for a
    target of ``facts`` (its draft vocabulary set) and ``train_tokens`` an epoch."""
    t, gpus = cfg.train, cfg.train.launch.world_size
    if t.recipe.max_train_seconds:
        hours = t.recipe.max_train_seconds / 3600
        return (f"training: {hours:,.1f} hours on {gpus} GPU(s) (train.recipe.max_train_seconds), {hours * gpus:,.0f} GPU "
                "hours")
    rate = measured_rate(cfg)
    if rate is None:
        m = MEASURED[0]
        return (f"training: GPU hours not estimated: the trainer's throughput is measured ({m.source}) only for "
                f"train.method {m.method}, k_train {m.k_train}, cod_ratio {m.cod_ratio}, max_len {m.max_len:,} in "
                f"{m.segments} segments, flex attention, optimizer {' or '.join(r.optimizer for r in MEASURED)}")
    if train_tokens is None:
        return "training: GPU hours unknown until the train split's size is (a hub set not counted here)"
    params = matrix_params(drafter_shape(cfg, facts), facts.target_hidden_size, len(facts.aux_layer_ids),
                           facts.draft_vocab_size or facts.vocab_size)
    per_gpu = rate.tokens_per_s * rate.matrix_params / params
    gpu_hours = t.recipe.epochs * train_tokens / per_gpu / 3600
    how = ("measured" if params == rate.matrix_params else
           f"projected from the {rate.tokens_per_s:,.0f} measured at Llama-3.1-8B's shape by matrix parameters, "
           f"{params / 1e6:,.0f}M against {rate.matrix_params / 1e6:,.0f}M")
    return (f"training: at most {gpu_hours:,.0f} {rate.gpu} GPU hours ({t.recipe.epochs} epochs x {train_tokens:,} tokens "
            f"at {per_gpu:,.0f} tokens/s a GPU, {how}: {rate.source}); {gpu_hours / gpus:,.0f} hours on "
            f"train.launch.world_size {gpus} GPUs if the ranks scale linearly")
