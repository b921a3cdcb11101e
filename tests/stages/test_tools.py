"""Tools for multi-turn rollouts (issue #21): Hermes parsing, the calculator, the sandboxed Python executor,
the runner (in-process and as Ray tasks) and the verl-style tool YAML. A tool that times out, raises or
prints megabytes ends as a bounded, recorded ToolResult, never an exception."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
import tracemalloc
from pathlib import Path

import pytest

from stages.tools.base import Tool, ToolError, ToolTimeout, truncate
from stages.tools.calculator import CalculatorTool
from stages.tools.config import load_tools
from stages.tools.parse import parse_tool_calls
from stages.tools.python_exec import PythonExecutorTool, network_prefix
from stages.tools.runner import run_tool_calls

ROOT = Path(__file__).resolve().parents[2]
CALC_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
PY_SCHEMA = {
    "type": "function",
    "function": {
        "name": "python",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}


def _call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _py(code: str, **config) -> str:
    return asyncio.run(PythonExecutorTool({"timeout_s": 2, **config}, PY_SCHEMA).call({"code": code}))


# ---- parsing --------------------------------------------------------------------------------------------


def test_parse_one_call_and_no_call() -> None:
    text = "Let me compute. " + _call("calculator", expression="123*45") + " then answer"
    (call,) = parse_tool_calls(text)
    assert (call.name, call.arguments, call.parse_error) == ("calculator", {"expression": "123*45"}, None)
    assert call.raw == _call("calculator", expression="123*45")
    assert parse_tool_calls("The answer is 5535.") == []
    assert parse_tool_calls('<tool_call>{"name": "calculator"') == []  # unclosed: no call (verl)


def test_parse_several_calls_and_string_arguments() -> None:
    string_args = '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
    calls = parse_tool_calls(_call("calculator", expression="1+1") + "\ntext\n" + string_args)
    assert [(c.name, c.arguments) for c in calls] == [
        ("calculator", {"expression": "1+1"}),
        ("python", {"code": "print(1)"}),
    ]
    assert all(c.parse_error is None for c in calls)


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ('{"name": "calculator", "arguments": {"expression": "1+1"}', "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"arguments": {}}', 'no "name" string'),
        ('{"name": "calculator", "arguments": [1]}', "must be a JSON object"),
        ('{"name": "calculator", "arguments": "{oops"}', "is a string that is not JSON"),
    ],
)
def test_parse_malformed_call_is_kept_with_its_error(body: str, error: str) -> None:
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert error in call.parse_error and call.arguments == {}


def test_parse_unknown_format_names_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown tool-call format 'react'; supported: \['hermes'\]"):
        parse_tool_calls("", fmt="react")


def test_truncate_stays_within_the_limit_and_says_how_much_it_cut() -> None:
    text = "x" * 1000
    for max_chars in (40, 100, 999):
        for tail in (False, True):
            cut = truncate(text, max_chars, tail=tail)
            assert len(cut) <= max_chars and f"[truncated {1000 - cut.count('x')} chars]" in cut
    assert truncate("short", 40) == "short"
    assert truncate("short", 40, dropped=10) == "short\n...[truncated 10 chars]"


# ---- calculator -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("123*45", "5535"),
        ("10/4", "2.5"),
        ("10/5", "2"),  # integral division prints as an int
        ("(2+3)*-4", "-20"),
        ("7//2 + 7%2", "4"),
        ("2**10", "1024"),
        ("2**-1", "0.5"),
        ("0.1+0.2", "0.3"),  # 15 significant digits
        ("1.5*2", "3"),
        ("99999999999999999999/3", "33333333333333333333"),  # exact for big ints
    ],
)
def test_calculator_values(expression: str, value: str) -> None:
    tool = CalculatorTool({}, CALC_SCHEMA)
    assert asyncio.run(tool.call({"expression": expression})) == value


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("1/0", "division by zero"),
        ("2^3", "write a\\*\\*b"),
        ("__import__('os')", "unsupported element"),
        ("x + 1", "unsupported element 'x'"),
        ("1 +", "could not parse"),
        ("", "empty expression"),
        ("1+" * 150 + "1", "over the limit of 200"),
        ("9**9**9", "too large"),
        ("10**100*10", "too large"),
        ("(-8)**0.5", "complex"),
    ],
)
def test_calculator_errors(expression: str, error: str) -> None:
    start = time.monotonic()
    with pytest.raises(ToolError, match=error):
        asyncio.run(CalculatorTool({}, CALC_SCHEMA).call({"expression": expression}))
    assert time.monotonic() - start < 1.0  # 9**9**9 is refused before it is computed


# ---- Python executor ------------------------------------------------------------------------------------


def test_python_prints_its_result_in_a_bare_env_and_a_deleted_temp_dir(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RLAKE_SECRET_TOKEN", "hunter2")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    code = (
        "import os\nopen('scratch.txt', 'w').write('kept inside')\nprint(123 * 45, 'RLAKE_SECRET_TOKEN' in os.environ)"
    )
    assert _py(code) == "5535 False"
    assert list(tmp_path.iterdir()) == []  # the call's temp dir is gone


def test_python_infinite_loop_times_out_in_bounded_time() -> None:
    start = time.monotonic()
    with pytest.raises(ToolTimeout, match="time limit of 1 s"):
        _py("while True:\n    pass", timeout_s=1)
    assert time.monotonic() - start < 4.0


def test_python_memory_bomb_is_an_error() -> None:
    with pytest.raises(ToolError, match="MemoryError"):
        _py("x = bytearray(10**10)")


def test_python_printing_10_mb_is_truncated_and_memory_bounded() -> None:
    tracemalloc.start()
    out = _py("print('x' * 10_000_000)", max_output_chars=1000)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(out) <= 1000 and out.endswith("chars]") and "...[truncated " in out
    assert peak < 2_000_000, f"{peak=}"  # a bounded reader: never the 10 MB


def test_python_cannot_write_outside_its_temp_dir(tmp_path) -> None:
    target = tmp_path / "escaped.txt"
    with pytest.raises(ToolError, match="PermissionError: sandbox: writing .* outside the working directory"):
        _py(f"open({str(target)!r}, 'w').write('x')")
    assert not target.exists()


@pytest.mark.parametrize(
    ("code", "error"),
    [
        ("import socket\nsocket.socket()", "network access is not allowed"),
        ("import urllib.request\nurllib.request.urlopen('http://127.0.0.1:9')", "network access is not allowed"),
        ("import subprocess\nsubprocess.run(['true'])", "starting a program is not allowed"),
        ("import os\nos.fork()", "forking is not allowed"),
        ("import os\nos.kill(os.getppid(), 9)", "signalling a process is not allowed"),
        ("import os\nos.remove('/etc/hostname')", "outside the working directory"),
    ],
)
def test_python_sandbox_refuses(code: str, error: str) -> None:
    with pytest.raises(ToolError, match=error):
        _py(code)


@pytest.mark.skipif(not network_prefix(), reason="unshare -rn / -n does not work on this machine")
def test_python_runs_in_an_empty_network_namespace() -> None:
    devices = _py("print(sorted(line.split(':')[0].strip() for line in open('/proc/net/dev').readlines()[2:]))")
    assert devices == "['lo']", devices


# ---- runner ---------------------------------------------------------------------------------------------


def _test_tools() -> dict[str, Tool]:
    """Tools that misbehave, defined in a function so Ray pickles them by value."""

    class Raising(Tool):
        async def call(self, arguments):
            raise RuntimeError("bug in the tool")

    class Sleeping(Tool):
        async def call(self, arguments):
            await asyncio.sleep(60)
            return "never"

    class Blocking(Tool):  # blocks its event loop: only a force-cancelled Ray task stops it
        async def call(self, arguments):
            time.sleep(60)
            return "never"

    def schema(name: str) -> dict:
        return {"type": "function", "function": {"name": name}}

    return {
        "calculator": CalculatorTool({}, CALC_SCHEMA),
        "python": PythonExecutorTool({"timeout_s": 2}, PY_SCHEMA),
        "raising": Raising({}, schema("raising")),
        "sleeping": Sleeping({"timeout_s": 0.5}, schema("sleeping")),
        "blocking": Blocking({"timeout_s": 0.5}, schema("blocking")),
    }


MISBEHAVING = [
    (_call("calculator", expression="123*45"), "5535", None),
    (
        _call("foo", x=1),
        "Error: unknown tool 'foo'; available: blocking, calculator, python, raising, sleeping",
        "unknown_tool",
    ),
    (_call("raising"), "Error: raising failed with RuntimeError: bug in the tool", "exception"),
    (_call("sleeping"), "Error: sleeping timed out after 0.5 s", "timeout"),
    (_call("calculator", expression="1/0"), "Error: division by zero", "tool_error"),
    (
        _call("calculator", expression=5),
        "Error: calculator: argument 'expression' must be of type string",
        "bad_arguments",
    ),
    ("<tool_call>{not json}</tool_call>", "Error: tool call is not valid JSON", "parse_error"),
]


def _check(results, expected) -> None:
    for result, (_, output, kind) in zip(results, expected, strict=True):
        assert result.output.startswith(output), result
        assert (result.error or "").split(":")[0] == (kind or ""), result
        assert result.latency_s >= 0


def test_runner_in_process_turns_every_failure_into_an_observation() -> None:
    calls = [c for text, _, _ in MISBEHAVING for c in parse_tool_calls(text)]
    start = time.monotonic()
    results = run_tool_calls(_test_tools(), calls, use_ray=False, timeout_s=5)
    assert time.monotonic() - start < 3.0  # concurrent, and the sleeper stopped at its 0.5 s
    _check(results, MISBEHAVING)


def test_runner_bounds_megabytes_of_output_and_python_timeouts() -> None:
    calls = parse_tool_calls(_call("python", code="print('y' * 5_000_000)") + _call("python", code="while 1: pass"))
    printed, looped = run_tool_calls(_test_tools(), calls, use_ray=False, max_output_chars=300)
    assert printed.error is None and len(printed.output) <= 300 and "...[truncated" in printed.output
    assert looped.error.startswith("timeout: the code ran over the time limit of 2 s") and len(looped.output) <= 300


def test_runner_outside_and_inside_an_event_loop() -> None:
    calls = parse_tool_calls(_call("calculator", expression="6*7"))

    async def from_a_coroutine():
        return run_tool_calls(_test_tools(), calls, use_ray=False)

    assert asyncio.run(from_a_coroutine())[0].output == "42"


def test_runner_with_ray_needs_a_running_ray() -> None:
    import ray

    if ray.is_initialized():
        pytest.skip("a Ray cluster of another test is running")
    with pytest.raises(RuntimeError, match="needs a running Ray"):
        run_tool_calls({}, [], use_ray=True)


@pytest.mark.ray
def test_runner_with_ray_tasks(ray_session, monkeypatch) -> None:
    import stages.tools.runner as runner

    tools = _test_tools()
    expected = [*MISBEHAVING, (_call("python", code="print(sum(range(10)))"), "45", None)]
    calls = [c for text, _, _ in expected for c in parse_tool_calls(text)]
    _check(run_tool_calls(tools, calls, use_ray=True, timeout_s=5), expected)  # timeouts inside the tasks

    # a tool blocking its event loop: the driver cancels the step's task with force RAY_SLACK_S after its deadline
    monkeypatch.setattr(runner, "RAY_SLACK_S", 3.0)
    start = time.monotonic()
    (blocked,) = run_tool_calls(tools, parse_tool_calls(_call("blocking")), use_ray=True, timeout_s=5)
    assert time.monotonic() - start < 10.0
    _check([blocked], [(None, "Error: the blocking tool timed out", "timeout")])  # cancelled at 0.5 s + 3 s


# ---- tool YAML ------------------------------------------------------------------------------------------


def test_load_both_tool_configs_from_any_directory(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # relative paths fall back to the repository root
    calc = load_tools("configs/tools/calculator.yaml")
    python = load_tools(ROOT / "configs/tools/python.yaml")
    assert list(calc) == ["calculator"] and isinstance(calc["calculator"], CalculatorTool)
    assert list(python) == ["python"] and isinstance(python["python"], PythonExecutorTool)
    assert python["python"].out_of_process and not calc["calculator"].out_of_process
    assert calc["calculator"].schema["function"]["parameters"]["required"] == ["expression"]
    assert calc["calculator"].timeout_s == 5.0 and python["python"].config["memory_mb"] == 256


CALC_ENTRY = """
  - class_name: stages.tools.calculator.CalculatorTool
    config: {type: native, timeout_s: 5}
    tool_schema:
      type: function
      function: {name: calculator, parameters: {type: object, properties: {expression: {type: string}}}}
"""


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("tool: []", "a mapping with one key, `tools:`"),
        ("tools:" + CALC_ENTRY.replace("calculator.CalculatorTool", "nope.CalculatorTool"), "cannot import module"),
        ("tools:" + CALC_ENTRY.replace("CalculatorTool", "ToolError"), "'ToolError' is not a Tool subclass"),
        ("tools:" + CALC_ENTRY.replace("stages.tools.calculator.CalculatorTool", "Calc"), "must be a dotted path"),
        ("tools:" + CALC_ENTRY + CALC_ENTRY, r"tools\[1\]: duplicate tool name 'calculator'"),
        ("tools:" + CALC_ENTRY.replace("name: calculator", "name: 'a b'"), "function.name is missing or invalid"),
        ("tools:" + CALC_ENTRY.replace("type: object", "type: string"), "must have type: object"),
        ("tools:" + CALC_ENTRY.replace("timeout_s: 5", "timeout: 5"), r"unknown config key\(s\) \['timeout'\]"),
        ("tools:" + CALC_ENTRY.replace("native", "mcp"), "'mcp' is not supported"),
        ("tools:" + CALC_ENTRY.replace("tool_schema", "schema"), "must have keys class_name, tool_schema"),
    ],
)
def test_bad_tool_config_says_what_is_wrong(tmp_path, text: str, error: str) -> None:
    path = tmp_path / "tools.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=error):
        load_tools(path)


def test_missing_tool_config_names_where_it_looked(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"tool config 'configs/tools/nope.yaml' not found .*tool_config_path"):
        load_tools("configs/tools/nope.yaml")


def _sandbox_children(pid: int) -> list[int]:
    """Pids of the live (not zombie) sandbox children of process `pid`, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if int(ppid) == pid and state != "Z" and b"sandbox_child.py" in cmdline:
            found.append(int(entry.name))
    return found


def test_python_child_dies_with_the_tool_process() -> None:
    """A tool process killed mid-call (what ray.cancel(force=True) does to its worker) leaves no orphan."""
    import subprocess
    import sys

    call = f"PythonExecutorTool({{'timeout_s': 60}}, {PY_SCHEMA!r}).call({{'code': 'import time; time.sleep(60)'}})"
    script = f"import asyncio\nfrom stages.tools.python_exec import PythonExecutorTool\nasyncio.run({call})"
    tool_proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    try:
        deadline = time.monotonic() + 20
        while not (children := _sandbox_children(tool_proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert children, "the sandbox child never started"
        workdirs = [Path(f"/proc/{c}/cmdline").read_bytes().split(b"\0")[-3].decode() for c in children]
        time.sleep(1.0)  # past its start-up (which exits by itself when its parent is already gone): in user code
    finally:
        tool_proc.kill()
        tool_proc.wait()
    deadline = time.monotonic() + 5  # the orphan is re-parented, so look it up by pid
    alive = children
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [c for c in children if _state(c) not in ("Z", "gone")]
    assert not alive, f"sandbox children {alive} outlived their tool process"
    for workdir in workdirs:  # a killed tool process cannot remove its call's temp dir (docs/tools.md)
        assert Path(workdir).name.startswith("rlake_tool_")
        shutil.rmtree(workdir, ignore_errors=True)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
