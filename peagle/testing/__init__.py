"""Small models for tests and benchmarks, never for a user's run: random tiny Llama targets with a
byte-level tokenizer (``tiny``), and the marker target with its golden head that must reach
acceptance K + 1 wherever vLLM loads a head right (``golden``). They build in seconds; their
weights are random, so they check shapes, plumbing and numerics, never quality.

Nothing in the pipeline imports this package (pyproject.toml's import contract)."""
