"""The data stage: prompt sources -> chat template + loss mask -> regenerate (vLLM) ->
extract (vLLM) -> shard store + manifest -> draft vocabulary.

Later stages only need the formats: ``peagle.data.store`` (``ShardReader`` / ``Sample``: the
hidden-state shards), ``peagle.data.vocab`` (``DraftVocab``: vocab.safetensors) and
``peagle.data.pipeline.DatasetInfo`` (what a build returns).
"""
