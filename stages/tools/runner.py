"""Running the tool calls of one assistant turn: concurrently, bounded in time and output, never raising.

Every call ends as a ToolResult. A call that cannot run (parse error, unknown tool, bad arguments), a tool
that raises, and a tool past its time all give an "Error: ..." observation for the model and `error` set
for the record; output is always cut to max_output_chars.

- use_ray=False: the calls run as coroutines on one event loop here, each under asyncio.wait_for. A tool that
  blocks the loop (synchronous CPU work) cannot be stopped this way: in-process tools must be quick pure
  functions (the calculator) or await a child process (the Python executor, which kills its child itself).
- use_ray=True: the step's calls run in one Ray task (num_cpus=0, no retries: a tool call is not repeated
  behind the model's back), concurrently inside it with the same wait_for; the driver waits RAY_SLACK_S past
  the longest deadline and then cancels the task with force (its worker process is killed, and with it any
  sandbox child).
The deadline of a call is min(timeout_s, tool.timeout_s), plus GRACE_S for a tool with its own child
process (start-up and clean-up), so the tool's own, more precise, timeout message wins.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any

import ray

from stages.tools.base import Tool, ToolCall, ToolError, ToolResult, ToolTimeout, truncate

GRACE_S = 1.0
RAY_SLACK_S = 30.0
"""Extra wait for a Ray task past its deadline before it is cancelled with force. The deadline is counted
from submission, and Ray starts workers a few at a time (seconds each on a busy node), so this is generous:
it only matters for a tool that blocks its event loop; every other timeout fires inside the task."""


def run_tool_calls(
    tools: dict[str, Tool],
    calls: list[ToolCall],
    *,
    use_ray: bool,
    timeout_s: float = 10.0,
    max_output_chars: int = 4096,
) -> list[ToolResult]:
    """One ToolResult per call, in the order of `calls`; raises only for a misuse of this function."""
    if use_ray:
        if not ray.is_initialized():
            raise RuntimeError("run_tool_calls(use_ray=True) needs a running Ray (ray.init or the RayResource)")
        return _run_with_ray(tools, calls, timeout_s, max_output_chars)
    coro = arun_tool_calls(tools, calls, timeout_s=timeout_s, max_output_chars=max_output_chars)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(1) as pool:  # called from inside an event loop: run ours on a thread of its own
        return pool.submit(asyncio.run, coro).result()


async def arun_tool_calls(
    tools: dict[str, Tool], calls: list[ToolCall], *, timeout_s: float = 10.0, max_output_chars: int = 4096
) -> list[ToolResult]:
    """run_tool_calls(use_ray=False) for a caller that is itself a coroutine."""
    return list(await asyncio.gather(*(_run_one(tools, c, timeout_s, max_output_chars) for c in calls)))


async def _run_one(tools: dict[str, Tool], call: ToolCall, timeout_s: float, max_chars: int) -> ToolResult:
    start = time.monotonic()
    tool, failure = _resolve(tools, call)
    output, error = failure or await call_tool(tool, call.arguments, deadline_s(tool, timeout_s))
    return ToolResult(call.name, call.arguments, truncate(output, max_chars), error, time.monotonic() - start)


def deadline_s(tool: Tool, timeout_s: float) -> float:
    """How long one call of `tool` may take (see the module docstring)."""
    return min(timeout_s, tool.timeout_s + (GRACE_S if tool.out_of_process else 0.0))


def _resolve(tools: dict[str, Tool], call: ToolCall) -> tuple[Tool | None, tuple[str, str] | None]:
    """The tool to run, or the (observation, error) of a call that cannot run."""
    if call.parse_error is not None:
        return None, (f"Error: {call.parse_error}", f"parse_error: {call.parse_error}")
    tool = tools.get(call.name)
    if tool is None:
        msg = f"unknown tool {call.name!r}; available: {', '.join(sorted(tools)) or '(none)'}"
        return None, (f"Error: {msg}", f"unknown_tool: {call.name!r}")
    try:
        tool.check_arguments(call.arguments)
    except ToolError as exc:
        return None, (f"Error: {exc}", f"bad_arguments: {exc}")
    return tool, None


async def call_tool(tool: Tool, arguments: dict[str, Any], deadline: float) -> tuple[str, str | None]:
    """(observation, error) of one call that stops at `deadline` seconds; never raises but for cancellation."""
    try:
        return str(await asyncio.wait_for(tool.call(arguments), deadline)), None
    except TimeoutError:
        return f"Error: {tool.name} timed out after {deadline:g} s", f"timeout: {tool.name} ran over {deadline:g} s"
    except ToolTimeout as exc:
        return f"Error: {exc}", f"timeout: {str(exc).splitlines()[0][:500]}"
    except ToolError as exc:
        return f"Error: {exc}", f"tool_error: {str(exc)[:500]}"
    except Exception as exc:  # a bug in the tool: the model sees it, the run goes on
        detail = f"{type(exc).__name__}: {exc}"
        return f"Error: {tool.name} failed with {detail}", f"exception: {detail[:500]}"


def _batch_in_worker(
    tools: dict[str, Tool], calls: list[ToolCall], timeout_s: float, max_chars: int
) -> list[ToolResult]:
    return asyncio.run(arun_tool_calls(tools, calls, timeout_s=timeout_s, max_output_chars=max_chars))


@lru_cache(maxsize=1)
def _remote_batch():
    """The Ray task, defined once per process so Ray exports it once."""
    return ray.remote(num_cpus=0, max_retries=0)(_batch_in_worker)


def _run_with_ray(tools: dict[str, Tool], calls: list[ToolCall], timeout_s: float, max_chars: int) -> list[ToolResult]:
    """All calls of the step in ONE Ray task, concurrent inside it (asyncio; the Python tool awaits its child
    process), so a step costs one task and Ray reuses one worker process across steps instead of starting a
    worker per call (seconds each on a small node). The driver cancels the task with force past the longest
    deadline plus RAY_SLACK_S: every call still running then gets a timeout error."""
    start = time.monotonic()
    runnable = [c for c in calls if _resolve(tools, c)[1] is None]
    if not runnable:
        return [_failed(tools, c, max_chars, start) for c in calls]
    wait = max(deadline_s(tools[c.name], timeout_s) for c in runnable) + RAY_SLACK_S
    ref = _remote_batch().remote(tools, calls, timeout_s, max_chars)
    ready, _ = ray.wait([ref], timeout=wait)
    if not ready:
        ray.cancel(ref, force=True)
        return [_lost(c, max_chars, start, f"timeout: Ray task cancelled after {wait:g} s") for c in calls]
    try:
        return ray.get(ref)
    except ray.exceptions.RayError as exc:  # the worker died (OOM kill, segfault) or was lost
        return [_lost(c, max_chars, start, f"worker_died: {type(exc).__name__}: {exc}"[:500]) for c in calls]


def _failed(tools: dict[str, Tool], call: ToolCall, max_chars: int, start: float) -> ToolResult:
    output, error = _resolve(tools, call)[1]
    return ToolResult(call.name, call.arguments, truncate(output, max_chars), error, time.monotonic() - start)


def _lost(call: ToolCall, max_chars: int, start: float, error: str) -> ToolResult:
    kind = "timed out" if error.startswith("timeout") else "crashed"
    output = f"Error: the {call.name} tool {kind}"
    return ToolResult(call.name, call.arguments, truncate(output, max_chars), error, time.monotonic() - start)
