"""Tools from a verl-style tool YAML (verl's `actor_rollout_ref.rollout.multi_turn.tool_config_path` file):

```yaml
tools:
  - class_name: stages.tools.calculator.CalculatorTool   # a dotted import path to a Tool subclass
    config: {type: native, timeout_s: 5}                  # the class's CONFIG_KEYS; unknown keys fail
    tool_schema:                                          # the OpenAI function schema the model is shown
      type: function
      function: {name: calculator, description: ..., parameters: {type: object, properties: {...}, required: [...]}}
```
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import yaml

from stages.tools.base import Tool

ROOT = Path(__file__).resolve().parents[2]
ENTRY_KEYS = {"class_name", "config", "tool_schema"}
EXAMPLE = "configs/tools/calculator.yaml"


def resolve_tool_config(path: str | Path) -> Path:
    """`path` as given when absolute or present under the current dir, else under the repository root."""
    p = Path(path).expanduser()
    for candidate in (p,) if p.is_absolute() else (Path.cwd() / p, ROOT / p):
        if candidate.is_file():
            return candidate
    looked = [str(p)] if p.is_absolute() else [str(Path.cwd() / p), str(ROOT / p)]
    raise FileNotFoundError(
        f"tool config '{path}' not found (looked at {looked}); set rollout.multi_turn.tool_config_path to a "
        f"tool YAML such as {EXAMPLE}"
    )


def load_tools(path: str | Path) -> dict[str, Tool]:
    """The tools of the YAML at `path`, by function name (in file order)."""
    file = resolve_tool_config(path)
    data = yaml.safe_load(file.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("tools"), list) or set(data) != {"tools"}:
        raise ValueError(f"{file}: a tool config is a mapping with one key, `tools:`, a list of tools; see {EXAMPLE}")
    tools: dict[str, Tool] = {}
    for i, entry in enumerate(data["tools"]):
        where = f"{file}: tools[{i}]"
        if not isinstance(entry, dict) or not {"class_name", "tool_schema"} <= set(entry) <= ENTRY_KEYS:
            got = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
            raise ValueError(f"{where} must have keys class_name, tool_schema and optionally config; got {got}")
        try:
            tool = tool_class(entry["class_name"])(entry.get("config") or {}, entry["tool_schema"])
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{where}: {exc}") from exc
        if tool.name in tools:
            raise ValueError(
                f"{where}: duplicate tool name '{tool.name}'; each tool_schema.function.name must be unique"
            )
        tools[tool.name] = tool
    return tools


def tool_class(class_name: Any) -> type[Tool]:
    """The Tool subclass at dotted path `class_name` ("package.module.Class")."""
    if not isinstance(class_name, str) or "." not in class_name:
        raise ValueError(
            f"class_name {class_name!r} must be a dotted path such as stages.tools.calculator.CalculatorTool"
        )
    module_name, _, attr = class_name.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"class_name {class_name!r}: cannot import module '{module_name}' ({exc})") from exc
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        found = sorted(
            n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, Tool) and v is not Tool
        )
        raise ValueError(
            f"class_name {class_name!r}: '{attr}' is not a Tool subclass in {module_name}; Tools there: {found}"
        )
    return cls
