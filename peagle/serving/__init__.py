"""Everything that touches vLLM: engines, the hidden-states connector, generation, metrics.

This is the only package that imports ``vllm``; importing it does not (vLLM loads
lazily inside the functions), so the rest of the library stays importable without it.
"""

from peagle.serving.engine import EngineStartError, is_cpu_platform, open_llm

__all__ = ["EngineStartError", "is_cpu_platform", "open_llm"]
