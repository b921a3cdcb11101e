"""Tool calls in a model turn's text.

Hermes format (Qwen2.5/Qwen3, NousResearch Hermes; verl's HermesToolParser): each call is one
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` span. As in verl, only closed spans count (a turn
cut off inside a span has no call). Unlike verl, a span whose body does not parse is kept, with
`parse_error` set, so the loop can show the model its mistake instead of silently ending the trajectory.
"""

from __future__ import annotations

import json
import re
from typing import Any

from stages.tools.base import ToolCall

HERMES_SPAN = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
FORMATS = ("hermes",)
"""The tool-call formats parse_tool_calls reads (rollout.multi_turn.format)."""


def parse_tool_calls(text: str, fmt: str = "hermes") -> list[ToolCall]:
    """Every tool call in `text`, in order. A malformed span gives a ToolCall with parse_error set."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool-call format {fmt!r}; supported: {list(FORMATS)}")
    return [_hermes_call(m.group(0), m.group(1)) for m in HERMES_SPAN.finditer(text)]


def _hermes_call(raw: str, body: str) -> ToolCall:
    """One span's ToolCall: body `{"name": str, "arguments": dict | JSON-object string}`; "arguments" may be
    left out (no arguments)."""
    try:
        obj: Any = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCall(
            "", {}, raw, f"tool call is not valid JSON ({exc.msg} at char {exc.pos}): {body.strip()!r:.120}"
        )
    if not isinstance(obj, dict):
        return ToolCall(
            "", {}, raw, f"tool call must be a JSON object with name and arguments, got {body.strip()!r:.120}"
        )
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", {}, raw, 'tool call has no "name" string; write {"name": "<tool>", "arguments": {...}}')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models emit the arguments as a JSON string (OpenAI's wire format)
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return ToolCall(name, {}, raw, f'"arguments" of {name} is a string that is not JSON ({exc.msg})')
    if not isinstance(args, dict):
        return ToolCall(name, {}, raw, f'"arguments" of {name} must be a JSON object, got {args!r:.80}')
    return ToolCall(name, args, raw, None)
