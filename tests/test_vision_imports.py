"""Every module of rewind.vision imports on its own, first, in a fresh interpreter; and no module
of the package imports one that imports it back (at the top or inside a function), the circle
there was between vlm (which listed the families) and the families (which took their base types
from vlm)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rewind.vision

PACKAGE = Path(rewind.vision.__file__).parent
MODULES = sorted(f"rewind.vision.{p.stem}" for p in PACKAGE.glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("module", MODULES)
def test_imports_fresh(module: str) -> None:
    src = str(PACKAGE.parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", f"import {module}"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def _imports(path: Path) -> set[str]:
    """rewind.vision modules `path` imports anywhere in it (lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in MODULES)
    return found


def test_no_import_circle() -> None:
    graph = {module: _imports(PACKAGE / f"{module.rsplit('.', 1)[1]}.py") for module in MODULES}

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        for nxt in graph[start]:
            if nxt == target or (nxt not in seen and reaches(nxt, target, seen | {nxt})):
                return True
        return False

    circles = [module for module in MODULES if reaches(module, module, {module})]
    assert not circles, f"import circles through {circles}: {graph}"
