"""The tree's layers and code rules, checked with `ast` (STYLE.md items 1, 12, 13; docs/architecture.md).

- Import direction: a module imports only its own layer and the layers below it (LAYERS, lowest first),
  counting module-level, function-level and `importlib.import_module("...")` imports; stages/algos also
  imports no third party but torch and numpy.
- No function or method outside tests/ is over 50 lines unless the line right above it (above its first
  decorator, if any) is a `# long: <why>` comment.
- stages/ calls workers by bound method: no "stages.module:function" string, and no module-level empty
  dict/list/set in stages/workers or the stage modules (live worker state belongs in worker attributes).

Each failure lists every offender as path:line.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("configs", "stages", "assets", "pipelines")  # what "ours" means below

# The layers, lowest first: a module may import its own layer and any layer listed before it, never one
# listed after it. A module belongs to the layer of its longest matching prefix, so `stages.run.resume` is
# in "run" and `stages.rollouts` (a stage module, stages/*.py) in "stage modules".
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # pydantic models + YAML
    ("configs", ("configs",)),
    # every seed formula, and the table of stages (asset and Delta table names): leaves every layer above
    # may import (they import only configs)
    ("seeds/dag", ("stages.seeds", "stages.dag")),
    # pure torch/numpy math (THIRD_PARTY_ONLY)
    ("algos", ("stages.algos",)),
    # datasets and rule rewards; engines and policy I/O; Delta tables, checkpoints, SQL, tracking
    ("data/models/io", ("stages.data", "stages.models", "stages.io")),
    # tools of multi-turn rollouts (calculator, Python sandbox, the runner) and the agent loop over an engine
    ("tools", ("stages.tools",)),
    # the PPO micro-batch loop, optimizers, batching, Megatron
    ("train", ("stages.train",)),
    # one Ray actor class per role + WorkerGroup
    ("workers", ("stages.workers",)),
    # stages/*.py: one module per asset, DAPO helpers
    ("stage modules", ("stages",)),
    # resume, replay, preflight, compare, export
    ("run", ("stages.run",)),
    # Dagster assets and resources
    ("assets", ("assets",)),
    # Definitions, jobs, sensors, the CLI
    ("pipelines", ("pipelines",)),
]
# Third-party packages a layer may import; a layer not listed here may import any.
THIRD_PARTY_ONLY = {"algos": {"torch", "numpy"}}
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}

SKIP_DIRS = {
    "tests",
    "rlake_output",
    "build",
    "dist",
    ".git",
    "__pycache__",
    ".venv",
    ".venv-vllm",
    ".venv-trl",
    ".hypothesis",
    ".ruff_cache",
}
MAX_FUNCTION_LINES = 50
LONG_MARK = "# long:"
DISPATCH_STRING = re.compile(r"stages\.[a-z_.]+:[a-z_]+")
STATE_NAME = re.compile(r"^_?[A-Z][A-Z0-9_]*$")
CONTAINER_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque"}


def layer_of(module: str) -> str:
    """The layer of a dotted module name of ours (longest matching prefix in LAYERS)."""
    best, best_len = "", -1
    for name, prefixes in LAYERS:
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = name, len(prefix)
    assert best, f"{module} is in no layer; add its package to LAYERS"
    return best


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def python_files(*tops: str) -> list[Path]:
    """Every .py file under `tops` (the repository when none), without tests/, build output and venvs."""
    roots = [ROOT / t for t in tops] if tops else [ROOT]
    return [
        path
        for root in roots
        for path in sorted(root.rglob("*.py"))
        if not any(p in SKIP_DIRS or p.endswith(".egg-info") for p in path.relative_to(ROOT).parts[:-1])
    ]


OUR_MODULES = {module_name(p) for top in PACKAGES for p in python_files(top)}


def imported_modules(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, dotted target) of every import in `tree`, at any depth; `from pkg import mod` names pkg.mod."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((node.lineno, sub if sub in OUR_MODULES else base))
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and (
                getattr(node.func, "attr", None) == "import_module"
                or getattr(node.func, "id", None) in ("import_module", "__import__")
            )
        ):
            found.append((node.lineno, node.args[0].value))
    return found


def import_violations(path: Path, source: str, module: str) -> list[str]:
    """Every import in `source` (the module `module` at `path`) that breaks LAYERS, as 'path:line: ...'."""
    layer = layer_of(module)
    tree = ast.parse(source)
    rel = path.relative_to(ROOT) if path.is_absolute() else path
    bad = []
    for line, target in dict.fromkeys(imported_modules(tree, module, path.name == "__init__.py")):
        root = target.split(".")[0]
        if root in PACKAGES:
            other = layer_of(target)
            if RANK[other] > RANK[layer]:
                bad.append(f"{rel}:{line}: {layer} imports {target} ({other}, a layer above it)")
        elif layer in THIRD_PARTY_ONLY and root not in sys.stdlib_module_names and root != "__future__":
            if root not in THIRD_PARTY_ONLY[layer]:
                allowed = sorted(THIRD_PARTY_ONLY[layer])
                bad.append(f"{rel}:{line}: {layer} imports {target}; it may import only {allowed} and the stdlib")
    return bad


@pytest.mark.parametrize("layer", [name for name, _ in LAYERS])
def test_imports_point_down_the_layers(layer):
    bad = []
    for path in python_files(*PACKAGES):
        module = module_name(path)
        if layer_of(module) == layer:
            bad += import_violations(path, path.read_text(), module)
    assert not bad, f"{len(bad)} import(s) against the layers (tests/test_layers.py LAYERS):\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        (
            "stages.train.loss",
            "def f():\n    from stages.run.resume import x\n",
            "stages/train/loss.py:2: train imports stages.run.resume (run, a layer above it)",
        ),
        (
            "stages.io.store",
            "from stages import rollouts\n",
            "stages/io/store.py:1: data/models/io imports stages.rollouts (stage modules, a layer above it)",
        ),
        (
            "stages.algos.kl",
            "import ray\n",
            "stages/algos/kl.py:1: algos imports ray; it may import only ['numpy', 'torch'] and the stdlib",
        ),
        (
            "assets.rollouts",
            "import importlib\nimportlib.import_module('pipelines.jobs')\n",
            "assets/rollouts.py:2: assets imports pipelines.jobs (pipelines, a layer above it)",
        ),
        (
            "configs.schema",
            "from ..stages import seeds\n",
            "configs/schema.py:1: configs imports stages.seeds (seeds/dag, a layer above it)",
        ),
    ],
)
def test_layer_rules_catch_upward_imports(module, source, expected):
    path = Path(*module.split(".")).with_suffix(".py")
    assert import_violations(path, source, module) == [expected]


@pytest.mark.parametrize(
    "source",
    [
        "from stages import seeds\n",
        "from stages.io.store import read_partition\n",
        "import torch\nfrom configs.schema import RunConfig\n",
    ],
)
def test_layer_rules_allow_downward_imports(source):
    assert import_violations(Path("stages/train/loss.py"), source, "stages.train.loss") == []


def long_functions(path: Path, source: str) -> list[str]:
    """Functions over MAX_FUNCTION_LINES lines without a `# long:` comment right above them."""
    lines = source.splitlines()
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            above = lines[first - 2].strip() if first >= 2 else ""
            if n > MAX_FUNCTION_LINES and not above.startswith(LONG_MARK):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name} is {n} lines")
    return bad


def test_functions_are_short_or_say_why():
    bad = [b for path in python_files() for b in long_functions(path, path.read_text())]
    assert not bad, (
        f"{len(bad)} function(s) over {MAX_FUNCTION_LINES} lines: split them, or put a "
        f"'{LONG_MARK} <why>' comment on the line above the def (or its decorator):\n" + "\n".join(bad)
    )


def test_stages_dispatch_no_remote_calls_by_string():
    bad = []
    for path in python_files("stages"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                match = DISPATCH_STRING.search(node.value)
                if match:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {match.group()!r}")
    assert not bad, (
        "'module:function' strings in stages/ (call a worker's bound method through WorkerGroup "
        "instead, e.g. group.call(ActorWorker.update, request)):\n" + "\n".join(bad)
    )


def _module_level(body: list[ast.stmt]):
    for stmt in body:
        yield stmt
        if isinstance(stmt, (ast.If, ast.Try)):
            yield from _module_level(stmt.body + stmt.orelse + getattr(stmt, "finalbody", []))


def _empty_container(value: ast.expr | None) -> bool:
    if isinstance(value, ast.Dict):
        return not value.keys
    if isinstance(value, (ast.List, ast.Set)):
        return not value.elts
    if isinstance(value, ast.Call):
        name = getattr(value.func, "id", None) or getattr(value.func, "attr", None)
        return name in CONTAINER_CALLS and (name == "defaultdict" or not (value.args or value.keywords))
    return False


def test_no_module_level_worker_state():
    stage_modules = [p for p in python_files("stages") if p.parent == ROOT / "stages"]
    bad = []
    for path in python_files("stages/workers") + stage_modules:
        for stmt in _module_level(ast.parse(path.read_text()).body):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
            value = getattr(stmt, "value", None)
            for target in targets:
                if isinstance(target, ast.Name) and STATE_NAME.match(target.id) and _empty_container(value):
                    bad.append(f"{path.relative_to(ROOT)}:{stmt.lineno}: {target.id}")
    assert not bad, (
        "module-level mutable containers in stages/workers or a stage module (keep live state in "
        "a worker's attributes, or make the table a constant):\n" + "\n".join(bad)
    )
