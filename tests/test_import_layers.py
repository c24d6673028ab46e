"""The import contracts (pyproject.toml's [tool.importlinter]) hold, and no module or package of
peagle or flows imports itself through others: a cycle is where the next import-order bug comes from."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def import_edges(granularity=lambda module: module):
    """peagle's and flows' imports (function-level and TYPE_CHECKING ones included: a type is a
    dependency too), each end mapped by ``granularity``."""
    import grimp
    import networkx as nx

    graph = grimp.build_graph("peagle", "flows", exclude_type_checking_imports=False, cache_dir=None)
    pairs = ((granularity(m), granularity(i)) for m in graph.modules for i in graph.find_modules_directly_imported_by(m))
    return nx.DiGraph((a, b) for a, b in pairs if a != b)


def cycles(edges) -> list[list[str]]:
    import networkx as nx

    return [sorted(c) for c in nx.strongly_connected_components(edges) if len(c) > 1]


def package_of(module: str) -> str:
    """``peagle.train.trainer`` -> ``peagle.train``; a top-level module is its own package."""
    return ".".join(module.split(".")[:2])


def test_no_module_imports_itself_through_others():
    assert cycles(import_edges()) == []


def test_no_package_imports_itself_through_others():
    assert cycles(import_edges(package_of)) == []


def test_the_import_contracts_are_kept():
    out = subprocess.run([str(Path(sys.executable).with_name("lint-imports")), "--no-cache"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_loading_a_config_and_importing_the_flows_loads_no_torch():
    """`peagle config check`, the CLI and a Prefect worker importing the flows start in well under a
    second; torch (seconds to import) loads only when a stage computes."""
    code = ("import sys; from peagle.config import load_config; load_config('configs/demo.yaml'); "
            "import peagle.cli, peagle.stages, flows.stages, flows.pipeline, flows.retrain; "
            "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"
