"""Hidden-state extraction requests: vLLM's ``extract_hidden_states`` method + our connector.

An extraction engine runs the target on each whole sequence as a prompt with
``max_tokens=1``; the aux-layer capture stores the residual stream after each requested
layer (id k = after k decoder layers, pre-norm; k = L, the last layer, included), and
the connector writes it to one file per request.
"""

from __future__ import annotations

from pathlib import Path

from peagle.serving.pool import spread_over_replicas


def extraction_speculative_config(layer_ids: list[int]) -> dict:
    """The ``speculative_config`` that captures the residual stream after ``layer_ids``."""
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
    }


def extraction_engine_kwargs(layer_ids: list[int], out_dir: Path) -> dict:
    """``open_llm`` keyword arguments that make an engine an extraction engine."""
    from peagle.serving.connector import hidden_states_kv_transfer_config

    return {
        "speculative_config": extraction_speculative_config(layer_ids),
        "kv_transfer_config": hidden_states_kv_transfer_config(out_dir),
    }


@spread_over_replicas()
def request_hidden_states(llm, prompts: list[list[int]]) -> list[str]:
    """Run each prompt once (one sampled token) and return its hidden-states file path.

    Paths come back in prompt order; the files may still be being written: read them
    with ``peagle.serving.connector.read_hidden_states_file``.
    """
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    paths = []
    for o in outputs:
        path = (o.kv_transfer_params or {}).get("hidden_states_path")
        if path is None:
            raise RuntimeError(
                "the engine returned no hidden_states_path: it was not started with "
                "extraction_engine_kwargs(...) (extract_hidden_states + PeagleHiddenStatesConnector)"
            )
        paths.append(path)
    return paths
