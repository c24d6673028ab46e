"""The data stage: prompt sources -> chat template + loss mask -> regenerate (vLLM) ->
extract (vLLM) -> shard store + manifest -> draft vocabulary.

Later stages only need the formats: ``ShardReader`` / ``Sample`` (hidden-state shards),
``DraftVocab`` (vocab.safetensors) and ``DatasetInfo`` (what ``build_dataset`` returns).
"""

_EXPORTS = {
    "ShardReader": "peagle.data.store",
    "ShardWriter": "peagle.data.store",
    "Sample": "peagle.data.store",
    "DraftVocab": "peagle.data.vocab",
    "build_dataset": "peagle.data.pipeline",
    "DatasetInfo": "peagle.data.pipeline",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    # Lazy, so importing one submodule (e.g. from the vLLM engine process) stays cheap.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'peagle.data' has no attribute {name!r}")
