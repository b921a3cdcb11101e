"""stages/algos modules: shape legend and size limits (STYLE.md sections 2-3).

Their imports (torch, numpy and the stdlib only) are checked with every other layer's in tests/test_layers.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ALGOS = Path(__file__).resolve().parents[2] / "stages" / "algos"
MODULES = sorted(p for p in ALGOS.glob("*.py"))
LEGEND = (
    "Shape legend: B prompts, G samples per prompt, N = B*G rollouts, P prompt len,\n"
    "L response len, T = P+L, V vocab. Masks are float {0,1}, 1 = counted in the loss."
)


@pytest.mark.parametrize("path", [p for p in MODULES if p.name != "__init__.py"], ids=lambda p: p.name)
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
