"""peagle: train P-EAGLE parallel-drafting heads for any target LLM and publish them for vLLM."""

__version__ = "0.1.0"
