"""The package's shape: modules import in one direction. Every import counts, function-local and
type-only ones too, as a reader follows them."""

from __future__ import annotations

import ast

import networkx as nx

from tests.conftest import ROOT

# Still one circle: the pipelines read the datamodule they serve, until they are composed from a spec.
KNOWN_CIRCLES = [{"vit.data.datamodules", "vit.data.pipelines"}]


def import_graph() -> nx.DiGraph:
    """vit's modules (a package's __init__ is not one) and the imports between them."""
    modules = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts): path
        for path in (ROOT / "vit").rglob("*.py")
        if path.name != "__init__.py"
    }
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(module.split(".")[: -node.level] + ([base] if base else []))
                names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            graph.add_edges_from((module, name) for name in names if name in modules and name != module)
    return graph


def test_no_module_imports_one_that_imports_it_back():
    circles = [set(c) for c in nx.strongly_connected_components(import_graph()) if len(c) > 1]
    assert [c for c in circles if c not in KNOWN_CIRCLES] == []


def test_the_graph_sees_a_circle_where_there_is_one():
    graph = import_graph()
    assert graph.has_edge("vit.lit", "vit.checkpoint") and graph.has_edge("vit.data.pipelines", "vit.data.prefetch")
    graph.add_edge("vit.checkpoint", "vit.lit")  # what a type hint from lit in checkpoint made
    assert {"vit.checkpoint", "vit.lit"} <= next(c for c in nx.strongly_connected_components(graph) if "vit.lit" in c)
