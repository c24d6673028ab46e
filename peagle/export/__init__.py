"""Publishing heads: the exporter of the vLLM head directory (``head``; what vLLM loads is
``peagle.contract``), its validator (``validate``), model card (``card``) and what
``peagle serve`` serves from a head directory (``serving_plan``).

The package imports none of its modules, so importing the card does not load the exporter and
its validator, which run vLLM."""
