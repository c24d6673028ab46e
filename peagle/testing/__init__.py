"""Models for tests and benchmarks, never for a user's run: random tiny Llama targets with a
byte-level tokenizer (``tiny``), and the marker target with its golden head that must reach
acceptance K + 1 wherever vLLM loads a head right (``golden``), which build in seconds and check
shapes, plumbing and numerics, never quality; and the tiny ``embedded`` test target, a small code
model trained from scratch in minutes (``embedded``).

Nothing in the pipeline imports this package (pyproject.toml's import contract)."""
