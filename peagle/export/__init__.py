"""Publishing heads: the vLLM head directory (``contract``: what vLLM loads), its exporter
(``head``), validator (``validate``, ``selftest``), model card (``card``) and what ``peagle
serve`` serves from a head directory (``serving_plan``).

The package imports none of its modules: ``contract`` is read by the lower layers (methods,
training, serving) without loading the exporter and its validator, which run vLLM."""
