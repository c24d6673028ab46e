#!/usr/bin/env bash
# The wheels bench/gpu_smoke.py needs on a GPU box that has CUDA torch and transformers and no
# network (Python 3.12, x86-64), into .whl/ (git ignores it): DeepSpeed, built here from its
# source release (PyPI ships no wheel of it; its ops compile on first use there), and the
# pure-Python or manylinux packages such a box lacks, at the versions this checkout runs.
# There: pip install --no-index --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=.:/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
rm -rf .whl && mkdir -p .whl
"$PY" -m pip wheel -q --no-deps --no-build-isolation "deepspeed==$(version deepspeed)" -w .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  "pydantic==$(version pydantic)" "pydantic-core==$(version pydantic-core)" \
  "annotated-types==$(version annotated-types)" "typing-inspection==$(version typing-inspection)" \
  "hjson==$(version hjson)"
du -sh .whl && ls .whl
