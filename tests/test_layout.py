"""The package's shape: modules import in one direction. Every import counts, function-local and
type-only ones too, as a reader follows them."""

from __future__ import annotations

import ast

import networkx as nx

from tests.conftest import ROOT

# vit's modules (a package's __init__ is not one), by name.
MODULES = {
    ".".join(path.relative_to(ROOT).with_suffix("").parts): path
    for path in (ROOT / "vit").rglob("*.py")
    if path.name != "__init__.py"
}


def import_graph() -> nx.DiGraph:
    """vit's modules and the imports between them."""
    graph = nx.DiGraph()
    graph.add_nodes_from(MODULES)
    for module, path in MODULES.items():
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
            graph.add_edges_from((module, name) for name in names if name in MODULES and name != module)
    return graph


def test_no_module_imports_one_that_imports_it_back():
    circles = [set(c) for c in nx.strongly_connected_components(import_graph()) if len(c) > 1]
    assert circles == []


def test_the_graph_sees_a_circle_where_there_is_one():
    graph = import_graph()
    assert graph.has_edge("vit.lit", "vit.checkpoint") and graph.has_edge("vit.data.pipelines", "vit.data.prefetch")
    graph.add_edge("vit.checkpoint", "vit.lit")  # what a type hint from lit in checkpoint made
    assert {"vit.checkpoint", "vit.lit"} <= next(c for c in nx.strongly_connected_components(graph) if "vit.lit" in c)


# The layers of the package, lowest first: a module imports from its own layer or a lower one, never
# from a higher one. A module is placed by the first row whose name or package prefix (ending in ".") it
# matches; a module no row places fails the test below until it is given a layer.
LAYERS = [
    ("basics", ("vit.options", "vit.wording", "vit.seeds", "vit.position", "vit.heads", "vit.lightning_compat",
                "vit.optim", "vit.schedule")),
    ("models", ("vit.layers.", "vit.vision_transformer", "vit.timm_args", "vit.registry", "vit.eva", "vit.relpos",
                "vit.sam", "vit.naflex", "vit.gpt", "vit.resnet")),
    ("data", ("vit.data.",)),
    ("checkpoint files", ("vit.checkpoint_files",)),
    ("weights, their adaptation, maps", ("vit.weights", "vit.adapt", "vit.checkpoint", "vit.relevance", "vit.render",
                                         "vit.explain", "vit.export")),
    ("training", ("vit.fault_tolerance", "vit.training", "vit.lit", "vit.language_model", "vit.sharding",
                  "vit.rollout")),
    ("commands", ("vit.cli", "vit.cli_errors", "vit.tools.")),
]  # fmt: skip


def layer_of(module: str) -> int | None:
    for rank, (_, names) in enumerate(LAYERS):
        if any(module == name or (name.endswith(".") and module.startswith(name)) for name in names):
            return rank
    return None


def package_exports() -> dict[str, str]:
    """`package.name` -> the module that defines it, for the names a package's __init__ imports (or
    lists in `_EXPORTS`, name -> module, when it imports them on first use): `from vit.layers import
    Block` is an import of vit.layers.blocks."""
    exports = {}
    for path in (ROOT / "vit").rglob("__init__.py"):
        package = ".".join(path.parent.relative_to(ROOT).parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    name = f"{node.module}.{alias.name}"  # a submodule (`from vit import eva`) or a name in one
                    exports[f"{package}.{alias.asname or alias.name}"] = name if name in MODULES else node.module
            elif isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_EXPORTS" for t in node.targets):
                pairs = zip(node.value.keys, node.value.values, strict=True)
                exports.update({f"{package}.{key.value}": value.value for key, value in pairs})
    return exports


def layered_graph() -> nx.DiGraph:
    """import_graph with the names taken from a package's __init__ followed to the module defining them."""
    graph, exports = import_graph(), package_exports()
    packages = {name.rpartition(".")[0] for name in exports}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in packages:
                found = (exports.get(f"{node.module}.{alias.name}") for alias in node.names)
                graph.add_edges_from((module, name) for name in found if name in MODULES and name != module)
    return graph


def upward_imports(graph: nx.DiGraph) -> list[str]:
    """Each import of a module from a higher layer, as 'importer (its layer) -> imported (its layer)'."""
    names = [name for name, _ in LAYERS]
    return [
        f"{a} ({names[layer_of(a)]}) -> {b} ({names[layer_of(b)]})"
        for a, b in sorted(graph.edges)
        if layer_of(a) is not None and layer_of(b) is not None and layer_of(a) < layer_of(b)
    ]


def test_every_module_has_a_layer():
    assert [module for module in sorted(MODULES) if layer_of(module) is None] == []


def test_no_module_imports_from_a_higher_layer():
    assert upward_imports(layered_graph()) == []


def test_the_layer_check_sees_an_upward_import():
    graph = layered_graph()
    assert graph.has_edge("vit.lit", "vit.heads")  # taken from the model side, not from training
    assert graph.has_edge("vit.checkpoint", "vit.data.preprocess")
    assert graph.has_edge("vit.vision_transformer", "vit.layers.blocks")  # `from vit.layers import Block`
    graph.add_edge("vit.checkpoint", "vit.lit")  # the weights layer taking a name from training: upward
    graph.add_edge("vit.data.images", "vit.data.pipelines")  # within a layer: allowed
    assert upward_imports(graph) == ["vit.checkpoint (weights, their adaptation, maps) -> vit.lit (training)"]
