"""Every config parameter is typed: a function parameter named `cfg` or `*_cfg` under stages/, pipelines/,
assets/ or configs/ carries an annotation (its pydantic section class, or configs.schema.RunConfig), so a
reader and a type checker know which section a function takes. Checked with `ast`, every offender as
path:line."""

from __future__ import annotations

import ast

import pytest

from tests.test_layers import ROOT, python_files

TOPS = ("stages", "pipelines", "assets", "configs")


def is_cfg_name(name: str) -> bool:
    return name == "cfg" or name.endswith("_cfg")


def untyped_cfg_params(source: str) -> list[tuple[int, str, str]]:
    """(line, function, parameter) of every `cfg`/`*_cfg` parameter without an annotation in `source`."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            params = a.posonlyargs + a.args + a.kwonlyargs + [p for p in (a.vararg, a.kwarg) if p]
            name = getattr(node, "name", "<lambda>")
            bad += [(p.lineno, name, p.arg) for p in params if is_cfg_name(p.arg) and p.annotation is None]
    return sorted(bad)


def test_every_cfg_parameter_is_annotated():
    files = python_files(*TOPS)
    assert len(files) > 20, f"found only {len(files)} files under {TOPS}"
    bad = [
        f"{path.relative_to(ROOT)}:{line}: {func}({param})"
        for path in files
        for line, func, param in untyped_cfg_params(path.read_text())
    ]
    assert not bad, (
        f"{len(bad)} config parameter(s) without a type: annotate each with its section class from "
        "configs/sections/*.py (or configs.schema.RunConfig):\n" + "\n".join(bad)
    )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def f(cfg): ...\n", [(1, "f", "cfg")]),
        ("def f(x, *, actor_cfg=None): ...\n", [(1, "f", "actor_cfg")]),
        ("class A:\n    async def g(self, lora_cfg, /): ...\n", [(2, "g", "lora_cfg")]),
        ("def f(\n    a: int,\n    model_cfg,\n): ...\n", [(3, "f", "model_cfg")]),
        ("h = lambda cfg: cfg\n", [(1, "<lambda>", "cfg")]),
        ("def f(cfg: RunConfig, filter_cfg: 'FilterGroupsConfig', config, cfgs, cfg_path): ...\n", []),
    ],
)
def test_check_finds_untyped_cfg_params(source, expected):
    assert untyped_cfg_params(source) == expected


def test_check_walks_the_tree_it_names():
    names = {p.relative_to(ROOT).parts[0] for p in python_files(*TOPS)}
    assert names == set(TOPS)
    assert ROOT / "stages" / "scored_rollouts.py" in python_files(*TOPS)
