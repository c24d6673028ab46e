"""The head directory vLLM loads: config keys, tensor names, shapes and dtypes.

One place states the contract (shared/design/vllm-contract.md, checked against vLLM
0.32's ``llama_eagle3.py``); the exporter writes it and the validator checks it, so the
two cannot drift apart. Names carry no ``model.`` prefix: vLLM's ``load_weights`` adds
it to everything except ``lm_head``, maps ``d2t`` to ``draft_id_to_target_id``, copies
``mask_hidden`` into a buffer and skips ``t2d``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from peagle.facts import HeadSpec

HEAD_ARCHITECTURE = "LlamaForCausalLMEagle3"
# Names vLLM 0.32 maps to the same Eagle3LlamaForCausalLM class (model registry).
ACCEPTED_ARCHITECTURES = {
    "LlamaForCausalLMEagle3",
    "Eagle3LlamaForCausalLM",
    "PeagleLlamaForCausalLM",
    "PEagleDraftModel",
}
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
CARD_FILE = "README.md"
FORMAT_VERSION = 1
MASK_HIDDEN = "mask_hidden"  # the tensor that lets a head draft K tokens in one pass (P-EAGLE's)

HEAD_DTYPES = ("float32", "bfloat16", "float16")  # the float dtypes a head may ship (config.json's torch_dtype)


@dataclass(frozen=True)
class TensorRule:
    """What one tensor of the head must look like; ``kind`` is float, int64 or bool."""

    shape: tuple[int, ...]
    kind: str
    why: str = ""


def draft_vocab_size(spec: HeadSpec) -> int:
    """Vd: the spec's draft vocabulary, or the whole target vocabulary when unset."""
    return spec.draft_vocab_size or spec.vocab_size


def ships_d2t(spec: HeadSpec) -> bool:
    """vLLM builds ``draft_id_to_target_id`` only when Vd < V; a d2t at Vd == V fails to load."""
    return draft_vocab_size(spec) < spec.vocab_size


def fc_input_size(spec: HeadSpec) -> int:
    return len(spec.aux_layer_ids) * spec.target_hidden_size


def expected_tensors(spec: HeadSpec, method_tensors: Mapping[str, TensorRule] | None = None) -> dict[str, TensorRule]:
    """Every tensor a head ships, with its shape: nothing more, nothing less. ``method_tensors``
    are its drafting method's own (``DraftingMethod.head_tensors``; P-EAGLE's ``mask_hidden``)."""
    h, v, vd = spec.hidden_size, spec.vocab_size, draft_vocab_size(spec)
    q_out = spec.num_heads * spec.head_dim
    kv_out = spec.num_kv_heads * spec.head_dim
    rules: dict[str, TensorRule] = {
        "embed_tokens.weight": TensorRule((v, h), "float", "the head's own table, with the learned mask row"),
        "fc.weight": TensorRule((h, fc_input_size(spec)), "float", "projects the concatenated aux states"),
        "norm.weight": TensorRule((h,), "float"),
        "lm_head.weight": TensorRule((vd, h), "float", "over the draft vocabulary"),
        "t2d": TensorRule((v,), "bool", "target id -> in draft vocabulary (read by tools, not vLLM)"),
    }
    for i in range(spec.num_layers):
        qkv_in = 2 * h if i == 0 else h  # layer 0 attends over concat(embedding, hidden)
        p = f"layers.{i}."
        rules |= {
            p + "self_attn.q_proj.weight": TensorRule((q_out, qkv_in), "float"),
            p + "self_attn.k_proj.weight": TensorRule((kv_out, qkv_in), "float"),
            p + "self_attn.v_proj.weight": TensorRule((kv_out, qkv_in), "float"),
            p + "self_attn.o_proj.weight": TensorRule((h, q_out), "float"),
            p + "input_layernorm.weight": TensorRule((h,), "float"),
            p + "post_attention_layernorm.weight": TensorRule((h,), "float"),
            p + "mlp.gate_proj.weight": TensorRule((spec.intermediate_size, h), "float"),
            p + "mlp.up_proj.weight": TensorRule((spec.intermediate_size, h), "float"),
            p + "mlp.down_proj.weight": TensorRule((h, spec.intermediate_size), "float"),
        }
    rules["layers.0.hidden_norm.weight"] = TensorRule((h,), "float", "norms the projected hidden in layer 0")
    if ships_d2t(spec):
        rules["d2t"] = TensorRule((vd,), "int64", "offsets: target_id = i + d2t[i]")
    return rules | dict(method_tensors or {})


def rope_parameters(spec: HeadSpec) -> dict:
    """transformers 5 reads ``rope_parameters``; older readers read rope_theta/rope_scaling."""
    params = dict(spec.rope_scaling) if spec.rope_scaling else {"rope_type": "default"}
    params.setdefault("rope_type", params.pop("type", "default"))
    params["rope_theta"] = spec.rope_theta
    return params


def check_head_dtype(name: str) -> str:
    """``name`` when a head may ship its float tensors in it (``HEAD_DTYPES``); else a clear error."""
    if name not in HEAD_DTYPES:
        raise ValueError(f"unsupported head dtype {name!r}; use one of {list(HEAD_DTYPES)}")
    return name


def head_config(spec: HeadSpec, dtype: str) -> dict:
    """config.json of a head whose float tensors are ``dtype`` (one of ``HEAD_DTYPES``); the mask id goes
    under every name vLLM versions read."""
    check_head_dtype(dtype)
    config = {
        "architectures": [HEAD_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_parameters": rope_parameters(spec),
        "max_position_embeddings": spec.max_position_embeddings,
        "vocab_size": spec.vocab_size,
        "draft_vocab_size": draft_vocab_size(spec),
        "target_hidden_size": spec.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": sorted(spec.aux_layer_ids),
        # vLLM 0.32 reads mask_token_id first, then pard_token, then ptd_token_id (0.16+).
        "mask_token_id": spec.mask_token_id,
        "ptd_token_id": spec.mask_token_id,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "dtype": dtype,  # transformers 5 spelling; must agree with torch_dtype
    }
    if spec.rope_scaling:
        config["rope_scaling"] = rope_parameters(spec)
    return config


# vLLM's speculative method for every head here (its EAGLE-3 drafter); not a peagle method name.
VLLM_SPEC_METHOD = "eagle3"


def head_tensor_names(head_dir: str | Path) -> list[str]:
    """The tensor names of a head directory's weights, once its config.json parses and its
    model.safetensors has a readable header with tensors; a ValueError naming the file if not
    (a truncated download or copy)."""
    from safetensors import SafetensorError, safe_open

    head_dir = Path(head_dir)
    try:
        json.loads((head_dir / CONFIG_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{head_dir / CONFIG_FILE} is not valid JSON: {err}") from None
    try:
        with safe_open(str(head_dir / WEIGHTS_FILE), framework="numpy") as fh:
            names = list(fh.keys())
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{head_dir / WEIGHTS_FILE} is not a readable safetensors file: {err}") from None
    if not names:
        raise ValueError(f"{head_dir / WEIGHTS_FILE} holds no tensors")
    return names


def drafts_in_parallel(head_dir: str | Path) -> bool:
    """Whether a head directory's weights draft K tokens in one pass (they ship ``mask_hidden``);
    raises ``head_tensor_names``' ValueError for a truncated or corrupt head."""
    return MASK_HIDDEN in head_tensor_names(head_dir)


def speculative_config(head_ref: str, k: int, *, parallel_drafting: bool = True) -> dict:
    """vLLM's ``--speculative-config`` for a head: P-EAGLE is EAGLE-3 with parallel drafting
    (pass the drafting method's ``parallel_drafting``)."""
    return {"model": head_ref, "method": VLLM_SPEC_METHOD, "num_speculative_tokens": k,
            "parallel_drafting": parallel_drafting}


NGRAM = "ngram"  # the label of vLLM's n-gram lookup rows, beside the heads' labels
NGRAM_DISPLAY = "n-gram lookup"  # how tables, plots and cards name it
# vLLM's prompt lookup: the longest n-gram (4 down to 2 tokens) that recurs in the context
# proposes the K tokens that followed it. No head, no training: the floor a head must beat.
NGRAM_LOOKUP = {"prompt_lookup_max": 4, "prompt_lookup_min": 2}


def ngram_speculative_config(k: int) -> dict:
    """vLLM's ``--speculative-config`` for training-free n-gram lookup at K draft tokens."""
    return {"method": "ngram", "num_speculative_tokens": k, **NGRAM_LOOKUP}
