"""The P-EAGLE drafter: an EAGLE-3 head that drafts K tokens in one forward pass.

This module computes exactly what vLLM's ``Eagle3LlamaForCausalLM``
(``vllm/model_executor/models/llama_eagle3.py``) computes when it serves the head with
``parallel_drafting``, and its ``state_dict()`` uses the head's own weight names:

    x     = embed_tokens(input_ids)                       [.., H]
    h     = fc(aux)  with aux = mask_hidden at mask slots [.., 3Ht] -> [.., H]
    layer 0:  r = h;  a = cat(input_layernorm(x), hidden_norm(h))   (2H into q/k/v)
    every layer:  r = attn(a) + r;  a = mlp(post_attention_layernorm(r));  later layers
              first do r = a + r;  a = input_layernorm(r)            (vLLM's fused add+norm)
    prenorm = a + r;  logits = lm_head(norm(prenorm))

vLLM projects ``mask_hidden`` through ``fc`` (``combine_hidden_states``) and feeds back
``prenorm`` (the final norm's residual output) as the next EAGLE-3 step's hidden state.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from peagle.config import AttentionBackend
from peagle.facts import HeadSpec
from peagle.fileio import atomic_path
from peagle.layout import CheckpointLayout
from peagle.model.target_weights import load_target_tensors

MASK_HIDDEN_INIT_STD = 0.02
# Every SDPA backend but cuDNN's. PyTorch picks cuDNN attention for bf16 on Hopper, and it builds
# a graph for every new sequence length, which takes hundreds of times as long as the
# memory-efficient kernel's whole forward and backward. A drafter's element count changes every
# training step and every evaluated prompt, so nearly every call would build.
# Flash attention takes no mask; the memory-efficient kernel takes any mask at any length.
MASKED_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# How the drafter evaluates an ``ElementRule`` (``AttentionBackend``, train.launch.attention): "flex" runs
# flex attention over the rule's block-sparse mask (only the 128 x 128 tiles the rule allows are
# computed, no [N, N] tensor exists); "dense" builds the [B, N, N] mask and runs SDPA; "auto" is
# flex on CUDA and dense elsewhere. On CPU, torch 2.13's flex attention has no backward, and a
# process's first flex calls compile it (35-50 s with a cold compile cache on 2 cores, 5-10 s
# more than the dense path's first calls with a warm one): more than the dense forward of the
# short examples CPU runs take, while from 2K tokens on flex's forward is faster and smaller
# (bench/results/attention_memory.md).


class ElementRule(Protocol):
    """An attention rule over a batch's elements that can be evaluated either way
    (``peagle.objective.masks.ElementAttention``: P-EAGLE's rule from anchor, depth, document)."""

    @property
    def shape(self) -> torch.Size: ...  # [B, N]

    def dense(self) -> torch.Tensor: ...  # Bool [B, N, N], True = q may attend to k

    def block_mask(self) -> BlockMask: ...  # the same rule for flex attention


def attention_backend(choice: AttentionBackend, device: torch.device) -> Literal["flex", "dense"]:
    """The path ``choice`` takes on ``device``: "auto" is flex on CUDA, dense elsewhere."""
    if choice == "auto":
        return "flex" if device.type == "cuda" else "dense"
    return choice


def check_attention_backend(choice: AttentionBackend, device: torch.device) -> None:
    """Refuse, before training starts, a backend that cannot train on ``device``."""
    if attention_backend(choice, device) == "flex" and not flex_trains_on(device):
        raise ValueError(
            f"train.launch.attention: flex cannot train on {device.type}: torch {torch.__version__} has no flex-attention "
            "backward there; set train.launch.attention: auto (flex on CUDA, dense elsewhere) or dense"
        )


def flex_trains_on(device: torch.device) -> bool:
    """Whether flex attention has a backward on ``device``'s type (torch refuses CPU and MPS)."""
    return device.type not in ("cpu", "mps")


@cache
def compiled_flex_attention():
    """flex attention compiled once per process (it only runs block-sparse when compiled).

    Shapes become dynamic the way torch's automatic dynamic makes them: the first batch
    compiles a static kernel, and a size that then changes (element count, tile count, batch
    size) compiles once more as dynamic, so a run builds a few kernels, not one per element
    count (a batch of a single 128-element tile takes one of its own). ``dynamic=True`` is
    not used: on CPU it fails to build for a ``mask_mod`` that reads captured tensors
    (torch 2.13).
    """
    return torch.compile(flex_attention)


class RMSNorm(nn.Module):
    """vLLM's RMSNorm (fp32 statistics, then weight), optionally fused with a residual add."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = x32.to(dtype) * self.weight
        return out if residual is None else (out, residual)


def rope_inv_freq(spec: HeadSpec) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scale for the spec's RoPE (theta + any scaling type)."""
    scaling = dict(spec.rope_scaling or {})
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    params = {**scaling, "rope_type": rope_type, "rope_theta": spec.rope_theta}
    if rope_type == "default":
        dim = spec.head_dim
        inv = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv, 1.0  # vLLM's float32 formula
    cfg = LlamaConfig(
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters=params,
    )
    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](cfg, None)
    return inv.float(), float(scale)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    """Neox-style RoPE (vLLM's ``is_neox_style=True`` for Llama), always computed in fp32.

    The frequencies are a plain attribute, not a buffer, so casting the module to bf16
    (DeepSpeed does) cannot round them.
    """

    def __init__(self, spec: HeadSpec):
        super().__init__()
        self.inv_freq, self.scale = rope_inv_freq(spec)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype):
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


class Attention(nn.Module):
    def __init__(self, spec: HeadSpec, in_features: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_proj = nn.Linear(in_features, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | BlockMask):
        """``mask``: a Bool [B, N, N] (SDPA) or a ``BlockMask`` (flex attention)."""
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if isinstance(mask, BlockMask):
            out = compiled_flex_attention()(q, k, v, block_mask=mask, scale=self.head_dim**-0.5,
                                            enable_gqa=self.num_kv_heads != self.num_heads)
            return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))
        if self.num_kv_heads != self.num_heads:
            rep = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        with sdpa_kernel(MASKED_ATTENTION_BACKENDS):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class MLP(nn.Module):
    def __init__(self, spec: HeadSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """vLLM's Eagle3 ``LlamaDecoderLayer``; layer 0 reads concat(norm(embeds), norm(hidden))."""

    def __init__(self, spec: HeadSpec, layer_idx: int):
        super().__init__()
        self.first = layer_idx == 0
        h = spec.hidden_size
        self.self_attn = Attention(spec, 2 * h if self.first else h)
        self.mlp = MLP(spec)
        self.input_layernorm = RMSNorm(h, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, spec.rms_norm_eps)
        if self.first:
            self.hidden_norm = RMSNorm(h, spec.rms_norm_eps)

    def forward(self, embeds, hidden, residual, cos, sin, mask):
        if self.first:
            residual = hidden
            hidden = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, mask)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


@dataclass
class DrafterOutput:
    logits: torch.Tensor  # [B, N, Vd], or [M, Vd] for the positions of ``logits_mask``
    hidden: torch.Tensor  # [B, N, H]: pre-final-norm residual stream, what EAGLE-3 feeds back


def _fold_mask_row(module: PEagleDrafter, state_dict: dict, prefix: str, local_metadata) -> None:
    """state_dict hook: the trained mask row goes into a copy of the table's entry (the head's
    names only; the frozen table itself stays as every data-parallel replica has it)."""
    row = state_dict.pop(prefix + "mask_embedding")
    key = prefix + "embed_tokens.weight"
    if state_dict[key].numel():  # an empty partition (ZeRO-3 outside a gather) has no row to write
        table = state_dict[key].detach().clone()
        table[module.spec.mask_token_id] = row.detach().to(table.dtype)
        state_dict[key] = table


def _unfold_mask_row(module: PEagleDrafter, state_dict: dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook: a head-format state dict's table row seeds ``mask_embedding``."""
    table = state_dict.get(prefix + "embed_tokens.weight")
    if table is not None and prefix + "mask_embedding" not in state_dict:
        state_dict[prefix + "mask_embedding"] = table[module.spec.mask_token_id].clone()


def _mask_hidden_as_head(module: PEagleDrafter, state_dict: dict, prefix: str, local_metadata) -> None:
    """state_dict post-hook: ``mask_hidden`` in the head's [1, 1, 3Ht] (checkpoints are heads)."""
    name = prefix + "mask_hidden"
    if name in state_dict:
        state_dict[name] = state_dict[name].reshape(1, 1, -1)


def _mask_hidden_as_vector(module: PEagleDrafter, state_dict: dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook: a head's [1, 1, 3Ht] ``mask_hidden`` loads into the vector."""
    name = prefix + "mask_hidden"
    if name in state_dict:
        state_dict[name] = state_dict[name].reshape(-1)


class PEagleDrafter(nn.Module):
    """P-EAGLE / EAGLE-3 drafter with vLLM's weight names (``state_dict()`` = head weights)."""

    def __init__(self, spec: HeadSpec):
        super().__init__()
        if spec.draft_vocab_size is None:
            raise ValueError(
                "HeadSpec.draft_vocab_size is unset: build the draft vocabulary first "
                "(spec.with_draft_vocab(Vd), or derive the spec from the dataset's target_facts.json)"
            )
        self.spec = spec
        h, ht = spec.hidden_size, spec.target_hidden_size
        self.embed_tokens = nn.Embedding(spec.vocab_size, h)
        self.fc = nn.Linear(3 * ht, h, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(h, spec.rms_norm_eps)
        self.lm_head = nn.Linear(h, spec.draft_vocab_size, bias=False)
        # A vector here, vLLM's [1, 1, 3Ht] in state_dict(): DeepSpeed's Muon takes every
        # parameter of two or more dimensions, and Muon's fixed-size orthogonal step would
        # barely move a 1 x 3Ht row; AdamW trains it as the recipe says.
        self.mask_hidden = nn.Parameter(torch.randn(3 * ht) * MASK_HIDDEN_INIT_STD)
        self.register_parameter("mask_embedding", None)  # the mask row's own, once train_mask_row_only
        self.register_state_dict_post_hook(_mask_hidden_as_head)
        self.register_load_state_dict_pre_hook(_mask_hidden_as_vector)
        self.rotary = Rotary(spec)
        # How an ElementRule is evaluated (train.launch.attention); not part of the weights.
        self.attention: AttentionBackend = "auto"
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | ElementRule,
        is_mask: torch.Tensor | None = None,
        hidden_override: torch.Tensor | None = None,
        override_mask: torch.Tensor | None = None,
        logits_mask: torch.Tensor | None = None,
    ) -> DrafterOutput:
        """Run all elements at once; ``attention_mask[b, q, k]`` True = q may attend to k.

        ``attention_mask`` is a Bool [B, N, N], or an ``ElementRule`` that ``self.attention``
        evaluates as flex attention's block-sparse mask or as that dense mask
        (``attention_backend``); both give the same outputs and gradients.
        ``is_mask`` slots use ``mask_hidden`` as their pre-fc feature; ``hidden_override``
        replaces fc(aux) where ``override_mask`` (EAGLE-3 training-time test feeds back the
        previous step's ``DrafterOutput.hidden``). ``logits_mask`` computes logits only for
        its True positions (returned flattened [M, Vd]) to save lm_head memory.
        """
        self._check_shapes(input_ids, aux_hidden, position_ids, attention_mask)
        embeds = self.embed(input_ids)
        features = aux_hidden.to(self.fc.weight.dtype)
        if is_mask is not None:
            features = torch.where(is_mask[..., None], self.mask_hidden.to(features.dtype), features)
        hidden = self.fc(features)
        if hidden_override is not None:
            if override_mask is None:
                raise ValueError("hidden_override needs override_mask (which positions take it)")
            hidden = torch.where(override_mask[..., None], hidden_override.to(hidden.dtype), hidden)
        mask = self._attention_mask(attention_mask, input_ids.device)
        cos, sin = self.rotary(position_ids, hidden.dtype)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(embeds, hidden, residual, cos, sin, mask)
        prenorm = hidden + residual
        normed = self.norm(prenorm)
        if logits_mask is not None:
            normed = normed[logits_mask]
        return DrafterOutput(logits=self.lm_head(normed), hidden=prenorm)

    def _attention_mask(self, attention_mask: torch.Tensor | ElementRule, device: torch.device):
        """What every layer's attention reads: a dense Bool [B, N, N] or a flex ``BlockMask``.

        In the dense mask every element attends to itself: padding rows would otherwise be
        all-False (NaN). The rule's block mask has the same diagonal.
        """
        if not isinstance(attention_mask, torch.Tensor):
            if attention_backend(self.attention, device) == "flex":
                self._check_flex_can_run(device)
                return attention_mask.block_mask()
            attention_mask = attention_mask.dense()
        n = attention_mask.shape[-1]
        return attention_mask | torch.eye(n, dtype=torch.bool, device=attention_mask.device)

    def _check_flex_can_run(self, device: torch.device) -> None:
        trains = torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())
        if trains and not flex_trains_on(device):
            raise RuntimeError(
                f"flex attention cannot compute gradients on {device.type} (torch {torch.__version__}): "
                "run it under torch.no_grad() there, or set the drafter's attention to 'dense' or 'auto'"
            )

    def _check_shapes(self, input_ids, aux_hidden, position_ids, attention_mask) -> None:
        b, n = input_ids.shape
        want = 3 * self.spec.target_hidden_size
        if aux_hidden.shape != (b, n, want):
            raise ValueError(f"aux_hidden has shape {tuple(aux_hidden.shape)}, expected {(b, n, want)} (3 aux layers x Ht)")
        if position_ids.shape != (b, n):
            raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}, expected {(b, n)}")
        if not isinstance(attention_mask, torch.Tensor):
            if tuple(attention_mask.shape) != (b, n):
                raise ValueError(f"the attention rule covers {tuple(attention_mask.shape)} elements, expected {(b, n)}")
            return
        if attention_mask.shape != (b, n, n) or attention_mask.dtype != torch.bool:
            raise ValueError(
                f"attention_mask must be bool [B,N,N]={(b, n, n)}, got {attention_mask.dtype} {tuple(attention_mask.shape)}"
            )

    # -- construction, persistence ------------------------------------------------------

    @classmethod
    def from_target(cls, spec: HeadSpec, target_path: str, draft_ids: torch.Tensor) -> PEagleDrafter:
        """A fresh drafter whose embeddings, final norm and lm_head start from the target's (when H == Ht).

        The final norm's per-channel gains are the scale the target's lm_head rows were trained
        against (SmolLM2's average 1.8, some negative), so a frozen lm_head reads the drafter's
        output as the target reads its own. The mask token's row is re-drawn (it is unused by the
        target, and must differ from the target's table so vLLM ships the learned row instead of
        sharing the target's).
        """
        draft_ids = torch.as_tensor(draft_ids, dtype=torch.long)
        if draft_ids.numel() != spec.draft_vocab_size:
            raise ValueError(
                f"draft_ids has {draft_ids.numel()} entries but spec.draft_vocab_size is {spec.draft_vocab_size}"
            )
        drafter = cls(spec)
        if not spec.as_wide_as_target:
            return drafter
        weights = load_target_tensors(target_path, draft_ids)
        embed, head = weights["embed_tokens"], weights["lm_head"]
        if embed.shape != drafter.embed_tokens.weight.shape:
            raise ValueError(
                f"target embeddings {tuple(embed.shape)} do not match the spec's [V, H] "
                f"{tuple(drafter.embed_tokens.weight.shape)}: the head spec was computed for another target"
            )
        with torch.no_grad():
            drafter.embed_tokens.weight.copy_(embed)
            row_std = embed.std().clamp_min(1e-3)
            drafter.embed_tokens.weight[spec.mask_token_id].normal_(0.0, float(row_std))
            drafter.lm_head.weight.copy_(head)
            drafter.norm.weight.copy_(weights["norm"])
        return drafter

    def init_mask_hidden(self, std: float) -> None:
        """Re-draw ``mask_hidden`` at ``std``: it enters ``fc`` beside real hidden states, so
        a scale near theirs (not a weight-init 0.02) lets the mask slots be told apart."""
        with torch.no_grad():
            self.mask_hidden.normal_(0.0, std)

    def train_mask_row_only(self) -> None:
        """Train the mask token's embedding row and nothing else of the table.

        The row becomes a parameter of its own (``mask_embedding``, [H]) and the table is frozen,
        so the optimizer, gradients and ZeRO partitions carry H values instead of V x H (a real
        model's table is 10-600M values). ``state_dict()`` still has the head's names only: the
        row is written back into ``embed_tokens.weight`` there, and loading a state dict takes
        the row from the table, so checkpoints, heads and warm starts keep one format.
        """
        if self.mask_embedding is not None:
            return
        row = self.spec.mask_token_id
        self.embed_tokens.weight.requires_grad_(False)
        self.mask_embedding = nn.Parameter(self.embed_tokens.weight.detach()[row].clone())
        self.register_state_dict_post_hook(_fold_mask_row)
        self.register_load_state_dict_pre_hook(_unfold_mask_row)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings; the mask token's from ``mask_embedding`` when it trains on its own."""
        embeds = self.embed_tokens(input_ids)
        if self.mask_embedding is None:
            return embeds
        is_mask = (input_ids == self.spec.mask_token_id)[..., None]
        return torch.where(is_mask, self.mask_embedding.to(embeds.dtype), embeds)

    def save(self, path: str | Path) -> None:
        """Write the state dict (head names) atomically as safetensors."""
        with atomic_path(path) as tmp:
            save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(tmp))

    @classmethod
    def from_checkpoint(cls, checkpoint: str | Path) -> PEagleDrafter:
        """The drafter a checkpoint directory holds, in the shape its ``head_spec.json`` records."""
        files = CheckpointLayout(checkpoint)
        for path in (files.drafter, files.head_spec):
            if not path.exists():
                raise FileNotFoundError(f"{path} not found: pass a checkpoint step directory written by the trainer")
        return cls.load(files.drafter, HeadSpec.load(files.head_spec))

    @classmethod
    def load(cls, path: str | Path, spec: HeadSpec) -> PEagleDrafter:
        """Weights from ``path`` into a drafter of ``spec`` (``from_checkpoint`` reads both)."""
        drafter = cls(spec)
        state = load_file(str(path))
        missing, unexpected = drafter.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"{path} does not match the head spec: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
            )
        return drafter
