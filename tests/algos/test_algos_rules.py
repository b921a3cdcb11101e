"""stages/algos stays pure: imports, shape legend, size limits (STYLE.md sections 1-3)."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ALGOS = Path(__file__).resolve().parents[2] / "stages" / "algos"
MODULES = sorted(p for p in ALGOS.glob("*.py"))
ALLOWED_THIRD_PARTY = {"torch", "numpy"}
LEGEND = ("Shape legend: B prompts, G samples per prompt, N = B*G rollouts, P prompt len,\n"
          "L response len, T = P+L, V vocab. Masks are float {0,1}, 1 = counted in the loss.")


def _imports(tree: ast.Module) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "use absolute imports (stages.algos.x)"
            names.append(node.module or "")
    return names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_algos_import_only_torch_numpy_stdlib(path):
    for name in _imports(ast.parse(path.read_text())):
        root = name.split(".")[0]
        ok = (root in ALLOWED_THIRD_PARTY or root in sys.stdlib_module_names
              or root == "__future__" or name.startswith("stages.algos"))
        assert ok, f"{path.name} imports '{name}'; stages/algos may import only torch, numpy, " \
                   "the stdlib and stages.algos"


@pytest.mark.parametrize("path", [p for p in MODULES if p.name != "__init__.py"],
                         ids=lambda p: p.name)
def test_algos_module_shape_legend_and_sizes(path):
    text = path.read_text()
    tree = ast.parse(text)
    assert LEGEND in (ast.get_docstring(tree, clean=False) or ""), f"{path.name}: no shape legend"
    assert "from __future__ import annotations" in text
    assert len(text.splitlines()) <= 400, f"{path.name} is over 400 lines"
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            assert n <= 60, f"{path.name}:{node.name} is {n} lines (limit 60)"
