"""Ordinary generation from token ids, so that ``peagle.data`` never imports vLLM.

Requests carry ``skip_hidden_states`` so that, on an engine also configured for
hidden-state extraction (``peagle.data.extract.open_data_engine``), generation writes
no hidden-state files; on any other engine the flag is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

from peagle.serving.pool import is_extraction_engine, spread_over_replicas

# Set in a request's kv_transfer_params: our connector then writes no hidden states for it.
SKIP_KEY = "skip_hidden_states"


@dataclass(frozen=True)
class Completion:
    text: str  # everything the model emitted, special/reasoning tokens included, minus the stop token
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort"


def check_sampling_supported(llm, temperature: float) -> None:
    """Refuse sampled generation on an extraction engine: vLLM 0.32 does not do it faithfully.

    Its extraction "drafter" proposes the token just sampled; greedy verification keeps
    the target's output exact, but with temperature > 0 the copy is accepted far too
    often: the output repeats tokens a plain engine almost never repeats.
    """
    if temperature > 0 and is_extraction_engine(llm):
        raise ValueError(
            f"temperature={temperature}: sampled generation on an extraction engine repeats tokens "
            "(vLLM 0.32 accepts the extraction method's copied drafts too often); regenerate greedily "
            "(data.regenerate.temperature: 0) or on a plain engine (peagle.serving.open_llm)"
        )


@spread_over_replicas("max_tokens", "seeds")
def generate_from_token_ids(
    llm,
    prompts: list[list[int]],
    *,
    max_tokens: list[int],
    temperature: float = 0.0,
    top_p: float = 1.0,
    seeds: list[int | None] | None = None,
) -> list[Completion]:
    """One completion per prompt, in prompt order.

    ``max_tokens`` and ``seeds`` are per prompt. Seeds make a sampled run repeatable
    with the same inputs; vLLM 0.32 does not make them batch-invariant.
    """
    from vllm import SamplingParams

    check_sampling_supported(llm, temperature)
    seeds = seeds or [None] * len(prompts)
    params = [
        SamplingParams(
            temperature=temperature,
            top_p=top_p,
            max_tokens=n,
            seed=seed if temperature > 0 else None,
            skip_special_tokens=False,  # keep reasoning/channel markers the target emits
            extra_args={"kv_transfer_params": {SKIP_KEY: True}},
        )
        for n, seed in zip(max_tokens, seeds, strict=True)
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        Completion(o.outputs[0].text, list(o.outputs[0].token_ids), o.outputs[0].finish_reason)
        for o in outputs
    ]
