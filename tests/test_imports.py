"""The import graph of the whole `rewind` package has no circle, and its packages import only
downwards; every module of rewind.vision also imports on its own, first, in a fresh interpreter.

The graph is read from the source with `ast`, so it holds every import wherever it sits: at the
top, inside a function (a lazy import hides a circle from Python, not from this test), under
`if TYPE_CHECKING:`. `from rewind.x import y` is an arrow to rewind.x.y when that is a module,
else to rewind.x (its __init__ runs). Circles this test has seen fixed: vision's vlm and its
families; kernels <-> engine.forward (split_model, now rewind.kernels.model_split);
prompt_cache <-> shared_tiers; commands generate <-> cache_prompt; env -> models.registry ->
paths -> env; server leases <-> runtime; and the arrow config -> cache (DiskFaults).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rewind

SRC = Path(rewind.__file__).parent.parent


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its __init__.py)."""
    found = {}
    for path in sorted((SRC / "rewind").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()
VISION = sorted(name for name in MODULES if name.startswith("rewind.vision."))


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module that `name` (a module, or a name in one) resolves to, if it is ours."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, source: str, modules: dict[str, Path]) -> dict[str, int]:
    """Our modules that `module` imports anywhere in `source`, each with its first line."""
    is_package = modules.get(module, Path()).name == "__init__.py"
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [_owner(alias.name, modules) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package that holds `module`
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules
                       else _owner(base, modules) for alias in node.names]
        else:
            continue
        for target in targets:
            if target is not None and target != module:
                found[target] = min(found.get(target, node.lineno), node.lineno)
    return found


def _graph() -> dict[str, dict[str, int]]:
    return {module: _imports(module, path.read_text(), MODULES) for module, path in MODULES.items()}


def _circles(graph: dict[str, dict[str, int]] | dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _layer(module: str) -> str:
    """A subpackage (rewind.cache) or a top-level module (rewind.env, rewind itself)."""
    parts = module.split(".")
    return ".".join(parts[:2])


# What a layer must never import: data flows server -> engine -> cache -> store; the kernels sit
# below the engine and the models; the plain top-level modules (env, paths, forms, config,
# memory, blas) below every package.
FORBIDDEN = {
    "rewind.cache": ("rewind.engine", "rewind.server", "rewind.commands", "rewind.models",
                     "rewind.kernels", "rewind.vision", "rewind.parallel", "rewind.bench"),
    "rewind.kernels": ("rewind.engine", "rewind.server", "rewind.commands", "rewind.models",
                       "rewind.cache", "rewind.vision", "rewind.parallel", "rewind.bench"),
    "rewind.engine": ("rewind.server", "rewind.commands", "rewind.parallel", "rewind.bench"),
    "rewind.models": ("rewind.engine", "rewind.server", "rewind.commands", "rewind.bench"),
    "rewind.vision": ("rewind.server", "rewind.commands", "rewind.parallel", "rewind.bench"),
    "rewind.server": ("rewind.commands", "rewind.bench"),
}
BASE = ("rewind.env", "rewind.forms", "rewind.paths", "rewind.config", "rewind.memory",
        "rewind.blas")


def test_the_graph_sees_every_kind_of_import() -> None:
    modules = {name: Path(f"{name.replace('.', '/')}.py")
               for name in ("rewind.a.b", "rewind.a.c", "rewind.a.d", "rewind.e", "rewind.f")}
    modules["rewind.a"] = Path("rewind/a/__init__.py")
    source = ("from typing import TYPE_CHECKING\n"
              "import os\n"
              "if TYPE_CHECKING:\n    from rewind.e import Thing\n"
              "def later():\n    from .c import helper\n    import rewind.f\n"
              "class K:\n    def m(self):\n        from . import d\n"
              "from rewind.a import Name\n")
    assert _imports("rewind.a.b", source, modules) == {
        "rewind.e": 4, "rewind.a.c": 6, "rewind.f": 7, "rewind.a.d": 10, "rewind.a": 11}
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle() -> None:
    graph = _graph()
    circles = _circles(graph)
    lines = []
    for component in circles:
        lines.append(" <-> ".join(component))
        lines += [f"    {module} -> {target} (line {line})" for module in component
                  for target, line in sorted(graph[module].items()) if target in component]
    assert not circles, "import circles in src/rewind:\n" + "\n".join(lines)


def test_packages_import_only_downwards() -> None:
    graph = _graph()
    layers: dict[str, set[str]] = {}
    arrows: list[str] = []
    for module, targets in graph.items():
        for target, line in targets.items():
            source_layer, target_layer = _layer(module), _layer(target)
            if source_layer == target_layer:
                continue
            layers.setdefault(source_layer, set()).add(target_layer)
            if target_layer in FORBIDDEN.get(source_layer, ()) or (
                    source_layer in BASE and target_layer not in BASE + ("rewind",)):
                arrows.append(f"{module} -> {target} (line {line})")
    assert not arrows, "imports running back up:\n" + "\n".join(arrows)
    circles = _circles(layers)
    assert not circles, f"circles between packages: {circles}"


@pytest.mark.parametrize("module", VISION)
def test_imports_fresh(module: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC),
                                                                    os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", f"import {module}"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
