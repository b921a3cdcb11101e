"""The tool interface (verl's BaseTool, reduced to what a multi-turn rollout needs) and the records a
tool call leaves: ToolCall (what the model asked for) and ToolResult (what it got back, and how long it took).

A tool is built from one entry of a verl-style tool YAML (stages/tools/config.py): `config` holds its
settings, `tool_schema` the OpenAI function schema the model is shown. `call` returns the observation text;
raising ToolError turns into an "Error: ..." observation, never a crashed run (stages/tools/runner.py).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""A function name OpenAI's tool schema accepts (and one a model can spell inside a <tool_call>)."""

JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}
"""JSON-schema type name -> the Python types json.loads gives for it (bool is checked apart: it is an int)."""


class ToolError(Exception):
    """An error the model should see as its observation ("Error: <message>"): bad input, a failed run,
    a limit hit. Any other exception a tool raises is reported too, with its type name."""


class ToolTimeout(ToolError):
    """A tool stopped its own work at its time limit (recorded as error kind "timeout")."""


@dataclass(frozen=True)
class ToolCall:
    """One <tool_call> span of a model turn. `raw` is the span as written (tags included); a span whose
    body is not `{"name": str, "arguments": dict}` JSON has `parse_error` set (and name "" when unknown)."""

    name: str
    arguments: dict[str, Any]
    raw: str
    parse_error: str | None = None


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one ToolCall. `output` is the observation text the model sees (an "Error: ..." text
    when the call failed), at most the runner's max_output_chars long. `error` is None on success, else
    "<kind>: <detail>" with kind one of parse_error, unknown_tool, bad_arguments, tool_error, exception,
    timeout, worker_died. `latency_s` is the wall time from submission to result."""

    name: str
    arguments: dict[str, Any]
    output: str
    error: str | None
    latency_s: float


def truncate(text: str, max_chars: int, dropped: int = 0, *, tail: bool = False) -> str:
    """`text` cut to at most `max_chars` characters, with a "...[truncated N chars]" marker when anything
    was dropped. `dropped` counts characters already dropped upstream (by a bounded reader) to add to N.
    Keeps the head, or with `tail` the end (where a traceback says what went wrong)."""
    if len(text) <= max_chars and not dropped:
        return text
    keep = min(len(text), max_chars)
    while keep > 0 and keep + len(_marker(len(text) - keep + dropped)) > max_chars:
        keep -= 1  # at most len(marker) steps
    marker = _marker(len(text) - keep + dropped)
    if tail:
        return (marker.strip() + "\n" + text[len(text) - keep :])[-max_chars:] if max_chars else ""
    return (text[:keep] + marker)[:max_chars]


def _marker(n: int) -> str:
    return f"\n...[truncated {n} chars]"


class Tool(ABC):
    """A tool a model calls by name with JSON arguments.

    Built as `Tool(config, tool_schema)` from one entry of a tool YAML. Subclasses implement `call` and list
    their own config keys in CONFIG_KEYS (with defaults); an unknown key fails at construction, like the
    run config's extra="forbid".
    """

    CONFIG_KEYS: ClassVar[dict[str, Any]] = {"type": "native", "timeout_s": 10.0}
    """Config key -> default. `type` is verl's tool type (only "native": an in-repo Python class);
    `timeout_s` is the wall time one call may take before the runner stops it."""

    out_of_process: ClassVar[bool] = False
    """True when the tool runs its input in a sandboxed child process of its own (PythonExecutorTool);
    False for tools that are safe to run in the caller's process (pure functions such as the calculator)."""

    def __init__(self, config: dict[str, Any] | None, tool_schema: dict[str, Any]) -> None:
        config = dict(config or {})
        unknown = sorted(set(config) - set(self.CONFIG_KEYS))
        if unknown:
            raise ValueError(
                f"{type(self).__name__}: unknown config key(s) {unknown}; valid keys: {sorted(self.CONFIG_KEYS)}"
            )
        self.config = {**self.CONFIG_KEYS, **config}
        if self.config["type"] != "native":
            raise ValueError(
                f"{type(self).__name__}: config.type {self.config['type']!r} is not supported; only 'native' "
                "(an importable Python class) is, verl's 'mcp' tools are not"
            )
        self.timeout_s = float(self.config["timeout_s"])
        if self.timeout_s <= 0:
            raise ValueError(f"{type(self).__name__}: config.timeout_s must be > 0, got {self.timeout_s}")
        self._schema = check_schema(tool_schema)

    @property
    def name(self) -> str:
        """The function name the model calls (tool_schema.function.name)."""
        return self._schema["function"]["name"]

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI function schema ({"type": "function", "function": {...}}), for the chat template."""
        return self._schema

    @abstractmethod
    async def call(self, arguments: dict[str, Any]) -> str:
        """The observation text for `arguments`; raise ToolError for an error the model should read."""

    def check_arguments(self, arguments: dict[str, Any]) -> None:
        """Raise ToolError when `arguments` miss a required parameter, name an unknown one, or have a value
        of the wrong JSON type or outside its enum (the runner checks before `call`)."""
        params = self._schema["function"].get("parameters") or {}
        props = params.get("properties") or {}
        missing = [k for k in params.get("required", []) if k not in arguments]
        if missing:
            raise ToolError(f"{self.name}: missing required argument(s) {missing}; expected {sorted(props)}")
        unknown = sorted(set(arguments) - set(props))
        if unknown and params.get("additionalProperties", True) is False:
            raise ToolError(f"{self.name}: unknown argument(s) {unknown}; expected {sorted(props)}")
        for key, value in arguments.items():
            spec = props.get(key) or {}
            types = spec.get("type")
            types = [types] if isinstance(types, str) else types or []
            ok = not types or any(
                isinstance(value, JSON_TYPES.get(t, object)) and (t == "boolean" or not isinstance(value, bool))
                for t in types
            )
            if not ok:
                raise ToolError(f"{self.name}: argument '{key}' must be of type {'/'.join(types)}, got {value!r:.80}")
            if "enum" in spec and value not in spec["enum"]:
                raise ToolError(f"{self.name}: argument '{key}' must be one of {spec['enum']}, got {value!r:.80}")


def check_schema(tool_schema: Any) -> dict[str, Any]:
    """`tool_schema` when it is an OpenAI function schema a model can be shown, else a ValueError saying
    what is wrong and what the shape must be."""
    shape = (
        "expected {type: function, function: {name: <[A-Za-z0-9_-]{1,64}>, description: <text>, "
        "parameters: {type: object, properties: {...}, required: [...]}}}"
    )
    if not isinstance(tool_schema, dict) or tool_schema.get("type") != "function":
        raise ValueError(f"tool_schema must be a mapping with type: function; {shape}")
    fn = tool_schema.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not TOOL_NAME.match(fn["name"]):
        raise ValueError(f"tool_schema.function.name is missing or invalid ({fn!r:.80}); {shape}")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type") != "object":
        raise ValueError(f"tool_schema.function.parameters of '{fn['name']}' must have type: object; {shape}")
    props = params.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
        raise ValueError(f"tool_schema.function.parameters.properties of '{fn['name']}' must map names to schemas")
    required = params.get("required", [])
    if not isinstance(required, list) or not set(required) <= set(props):
        raise ValueError(
            f"tool_schema.function.parameters.required of '{fn['name']}' ({required!r}) must list names "
            f"from properties {sorted(props)}"
        )
    return tool_schema
