"""Tools for multi-turn rollouts (issue #21; docs/tools.md): the Tool interface, Hermes tool-call parsing,
verl-style tool YAML, a calculator and a sandboxed Python executor, and a runner that never raises."""

from stages.tools.agent_loop import Trajectory, run_agent_loop
from stages.tools.base import Tool, ToolCall, ToolError, ToolResult, ToolTimeout, truncate
from stages.tools.config import load_tools, resolve_tool_config
from stages.tools.parse import FORMATS, parse_tool_calls
from stages.tools.runner import arun_tool_calls, run_tool_calls

__all__ = [
    "FORMATS",
    "Tool",
    "ToolCall",
    "ToolError",
    "ToolResult",
    "ToolTimeout",
    "arun_tool_calls",
    "Trajectory",
    "load_tools",
    "resolve_tool_config",
    "run_agent_loop",
    "parse_tool_calls",
    "run_tool_calls",
    "truncate",
]
