"""Layers import downward only: transport <- runtime <- actors <- the ``treeserve`` façade, and
``ops`` imports none of them; training (``treeserve.training``) sits beside the façade, and no
serving layer imports it; no production module imports the test helpers (``treeserve_testing``,
under ``tests/``, which the installed package does not hold).
And no production modules import each other in a cycle.

Every production module's imports are read with ``ast``, those inside functions, methods and
``if TYPE_CHECKING:`` blocks included, and relative imports resolved. The folders come from
``pyproject.toml``'s package mapping, so a new folder is checked as soon as it is mapped.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# What each layer may import (besides itself and third-party code). The façade sits on top;
# the test helpers ("testing") are used by no layer.
ALLOWED: dict[str, frozenset[str]] = {
    "transport": frozenset({"transport"}),
    "runtime": frozenset({"transport", "runtime"}),
    "ops": frozenset({"ops"}),
    "actors": frozenset({"transport", "runtime", "ops", "actors"}),
    "façade": frozenset({"transport", "runtime", "ops", "actors", "façade", "training"}),
    "training": frozenset({"ops", "façade", "training"}),
}
_LAYER_PACKAGES = {
    "treeserve.transport": "transport",
    "treeserve.runtime": "runtime",
    "treeserve.ops": "ops",
    "treeserve.actors": "actors",
    "treeserve.training": "training",
}


def layer_of(module: str) -> str | None:
    """The layer of a ``treeserve.*`` module name (``testing`` for the test helpers); None for a
    module outside treeserve."""
    if module == "treeserve_testing" or module.startswith("treeserve_testing."):
        return "testing"
    if module != "treeserve" and not module.startswith("treeserve."):
        return None
    for package, layer in _LAYER_PACKAGES.items():
        if module == package or module.startswith(package + "."):
            return layer
    return "façade"


def package_folders() -> dict[str, Path]:
    """Package name -> folder, as ``pyproject.toml`` maps them."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    mapping = config["tool"]["setuptools"]["package-dir"]
    return {name: REPO / folder for name, folder in mapping.items()}


def package_modules() -> dict[str, Path]:
    """Module name -> file of every module the package installs, test helpers included."""
    folders = package_folders()
    modules: dict[str, Path] = {}
    for package, folder in folders.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts))
            if name.endswith(".__init__"):
                name = name[: -len(".__init__")]
            # A file in a subfolder mapped on its own is named by that mapping (the longest).
            owner = max((p for p, f in folders.items() if path.is_relative_to(f)), key=len)
            if owner == package:
                modules[name] = path
    return modules


def from_base(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from ... import`` reads, relative imports resolved against ``package``."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    return ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))


def imported_modules(source: str, module: str, *, is_package: bool) -> Iterator[tuple[int, str]]:
    """``(line, module name)`` of every import in ``source``, at any depth of the tree.

    ``from treeserve import ops`` yields ``treeserve.ops``: a name imported from the root
    package is attributed to its own layer (the root itself runs for every import anyway).
    """
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = from_base(node, package)
            if base == "treeserve":
                for alias in node.names:
                    yield node.lineno, f"treeserve.{alias.name}"
            else:
                yield node.lineno, base


def upward_imports(source: str, module: str, *, is_package: bool = False) -> list[str]:
    """Each import of ``source`` (the text of ``module``) that its layer may not make."""
    own = layer_of(module)
    assert own is not None, module
    found = []
    for line, target in imported_modules(source, module, is_package=is_package):
        layer = layer_of(target)
        if layer is not None and layer not in ALLOWED[own]:
            found.append(f"{module}:{line} ({own}) imports {target} ({layer})")
    return found


def test_the_installed_package_holds_no_test_code() -> None:
    tests = REPO / "tests"
    assert all(not folder.resolve().is_relative_to(tests) and "testing" not in name
               for name, folder in package_folders().items()), package_folders()


def test_no_production_module_imports_upward() -> None:
    modules = package_modules()
    layers = {layer_of(name) for name in modules}
    # Every layer has files here: a mapping the walk misread would check nothing.
    assert layers == set(ALLOWED), layers
    known = {"treeserve.transport.codec", "treeserve.runtime.node", "treeserve.ops.loaders.gguf",
             "treeserve.actors.verifier", "treeserve.cli"}
    assert known <= modules.keys(), known - modules.keys()
    found = []
    for name, path in modules.items():
        source = path.read_text(encoding="utf-8")
        found += upward_imports(source, name, is_package=path.name == "__init__.py")
    assert not found, "imports against the layering:\n" + "\n".join(found)


def test_the_check_sees_imports_at_any_depth() -> None:
    hidden = (
        "import torch\n"
        "from treeserve.ops.model import Transformer\n"
        "def load():\n"
        "    from treeserve.models import load_model\n"
        "    return load_model\n"
        "class A:\n"
        "    def m(self):\n"
        "        import treeserve.training.predictor\n"
        "        import treeserve.server\n"
    )
    assert upward_imports(hidden, "treeserve.actors.verifier") == [
        "treeserve.actors.verifier:4 (actors) imports treeserve.models (façade)",
        "treeserve.actors.verifier:8 (actors) imports treeserve.training.predictor (training)",
        "treeserve.actors.verifier:9 (actors) imports treeserve.server (façade)",
    ]
    # Training sits beside the façade, off the serving path: no serving layer imports it.
    assert upward_imports("from treeserve.training import distill\n", "treeserve.ops.ssm") == [
        "treeserve.ops.ssm:1 (ops) imports treeserve.training (training)",
    ]
    assert upward_imports("from treeserve import client\n", "treeserve.runtime.node") == [
        "treeserve.runtime.node:1 (runtime) imports treeserve.client (façade)",
    ]
    assert upward_imports("from treeserve import ops\n", "treeserve.transport.codec") == [
        "treeserve.transport.codec:1 (transport) imports treeserve.ops (ops)",
    ]
    assert upward_imports("import treeserve\n", "treeserve.actors.gateway.actor") == [
        "treeserve.actors.gateway.actor:1 (actors) imports treeserve (façade)",
    ]
    # ops imports none of the serving layers; nothing imports the test helpers.
    assert upward_imports("if X:\n    from treeserve.runtime import Actor\n", "treeserve.ops.model") == [
        "treeserve.ops.model:2 (ops) imports treeserve.runtime (runtime)",
    ]
    assert upward_imports("from treeserve_testing.runtime_actors import EchoActor\n", "treeserve.server") == [
        "treeserve.server:1 (façade) imports treeserve_testing.runtime_actors (testing)",
    ]
    # Relative imports resolve against the module's package.
    assert upward_imports("from ..actors import gateway\n", "treeserve.runtime.node") == [
        "treeserve.runtime.node:1 (runtime) imports treeserve.actors (actors)",
    ]
    assert upward_imports("from .. import actors\n", "treeserve.runtime.node") == [
        "treeserve.runtime.node:1 (runtime) imports treeserve.actors (actors)",
    ]
    assert upward_imports("from . import codec\nfrom .wire import Kind\n", "treeserve.transport", is_package=True) == []
    assert upward_imports(hidden.replace("treeserve.models", "treeserve.ops.loaders.load")
                          .replace("import treeserve.training.predictor", "import treeserve.ops.length_predictor")
                          .replace("import treeserve.server", "import treeserve.ops.ssm"),
                          "treeserve.actors.verifier") == []


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports (at any depth, ``TYPE_CHECKING`` blocks
    included); ``from package import module`` is an edge to that module."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        package = name if is_package else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = from_base(node, package)
                edges |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_production_modules_import_each_other_in_a_cycle() -> None:
    graph = import_graph(package_modules())
    assert "treeserve.ops.kernels.decode_layers" in graph["treeserve.ops.fused_step"]  # from package import module
    assert not cycles(graph), "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles(graph))


def test_the_cycle_check_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c"]]
    graph["d"] = {"b"}
    assert cycles(graph) == [["a", "b", "c", "d"]]


def private_imports(source: str) -> list[str]:
    """The ``_private`` names ``source`` imports from treeserve modules."""
    return [f"{node.lineno}: {node.module}.{alias.name}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("treeserve")
            for alias in node.names if alias.name.startswith("_")]


def test_the_benchmarks_use_public_names_only() -> None:
    found = [f"bench/{path.name}:{hit}" for path in sorted((REPO / "bench").glob("*.py"))
             for hit in private_imports(path.read_text(encoding="utf-8"))]
    assert not found, "private names the benchmarks import:\n" + "\n".join(found)
    assert private_imports("from treeserve.ops.model import _x, Transformer\n") == ["1: treeserve.ops.model._x"]


MAX_FUNCTION_LINES = 80


def long_functions(source: str, module: str) -> list[str]:
    """Functions and methods of ``source`` longer than :data:`MAX_FUNCTION_LINES` lines."""
    return [f"{module}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno is not None and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_production_function_is_over_80_lines() -> None:
    found = [hit for name, path in package_modules().items()
             for hit in long_functions(path.read_text(encoding="utf-8"), name)]
    assert not found, "functions over 80 lines:\n" + "\n".join(found)
    long = "def f():\n" + "    x = 1\n" * 80
    assert long_functions(long, "m") == ["m:1 f (81 lines)"] and long_functions(long[:-10], "m") == []


MAX_MODULE_LINES = 450
NATIVE_SUFFIXES = (".cpp", ".h", ".cu")


def native_sources() -> dict[str, Path]:
    """``package/file`` -> file of every C++ or CUDA source and header the package ships (its
    package data: the kernels' translation units and their headers)."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    folders = package_folders()
    return {f"{package}/{path.name}": path
            for package, patterns in config["tool"]["setuptools"]["package-data"].items()
            for pattern in patterns if pattern.endswith(NATIVE_SUFFIXES)
            for path in sorted(folders[package].glob(pattern))}


def test_no_production_module_is_over_450_lines() -> None:
    sizes = {name: len(path.read_text(encoding="utf-8").splitlines()) for name, path in package_modules().items()}
    assert len(sizes) > 100 and max(sizes.values()) > 300  # the walk found the package
    native = {name: len(path.read_text(encoding="utf-8").splitlines()) for name, path in native_sources().items()}
    assert {Path(name).suffix for name in native} == set(NATIVE_SUFFIXES)  # and the kernels' sources
    found = [f"{name}: {lines} lines" for name, lines in sorted((sizes | native).items()) if lines > MAX_MODULE_LINES]
    assert not found, "modules and kernel sources over 450 lines:\n" + "\n".join(found)
