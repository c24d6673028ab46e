"""The tiny ``embedded`` test target (``target.model: embedded``, configs/tiny.yaml): a small
Llama code model trained from scratch on this Python's standard library, offline, in minutes,
and cached under ``PEAGLE_HOME/targets`` by its recipe's hash (``peagle.target.embedded``);
and the demo's code prompt files, made from the same split of the standard library
(``python -m peagle.testing.embedded.prompts``). Tests and benchmarks build it
(``python -m peagle.testing.embedded``); it ignores its prompts and loops, so it measures
plumbing and speed, never quality."""

from peagle.testing.embedded.build import build_embedded_target

__all__ = ["build_embedded_target"]
