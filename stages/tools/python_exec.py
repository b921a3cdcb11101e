"""PythonExecutorTool: runs model-written Python in a separate, limited process.

Each call gets a fresh temp dir (its cwd, HOME and TMPDIR; deleted afterwards), a bare environment, and a
`python -I -B` child (stages/tools/sandbox_child.py) with, before the user's code runs:
- limits: wall time `timeout_s` (the process group is SIGKILLed), CPU time (RLIMIT_CPU, timeout_s + 1),
  memory (RLIMIT_AS/RLIMIT_DATA, memory_mb), file size (RLIMIT_FSIZE, file_mb), 64 open files, no core dumps;
- an audit hook that refuses sockets, new processes, signals, ctypes calls and writes outside the temp dir;
- no network at all when `unshare -rn` (or `-n`) works on this machine (probed once per process);
- death with its parent (PR_SET_PDEATHSIG), so a Ray task cancelled with force leaves no orphan.
stdout and stderr are read through bounded buffers: a child printing gigabytes costs time (until timeout_s),
never memory. What is not isolated (reads of any file, CPU of other cores, an adversary): docs/tools.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

from stages.tools.base import Tool, ToolError, ToolTimeout, truncate

CHILD = str(Path(__file__).with_name("sandbox_child.py"))
NETWORK_MODES = ("auto", "required", "off")
SIGNALS = {
    signal.SIGXCPU: "CPU time limit exceeded",
    signal.SIGXFSZ: "file size limit exceeded",
    signal.SIGKILL: "killed (over a limit)",
    signal.SIGSEGV: "segmentation fault (often memory exhausted)",
}


class PythonExecutorTool(Tool):
    """Runs `arguments["code"]`; the observation is its stdout. A non-zero exit, a limit hit or a timeout is a
    ToolError whose text carries the stderr tail (the traceback)."""

    CONFIG_KEYS: ClassVar[dict[str, Any]] = {
        **Tool.CONFIG_KEYS,
        "timeout_s": 5.0,
        "memory_mb": 256,
        "file_mb": 16,
        "max_output_chars": 4096,
        "network_namespace": "auto",
    }
    out_of_process = True

    def __init__(self, config: dict[str, Any] | None, tool_schema: dict[str, Any]) -> None:
        super().__init__(config, tool_schema)
        c = self.config
        if c["network_namespace"] not in NETWORK_MODES:
            raise ValueError(f"config.network_namespace {c['network_namespace']!r} must be one of {NETWORK_MODES}")
        if c["memory_mb"] < 64 or c["file_mb"] < 1 or c["max_output_chars"] < 64:
            raise ValueError(
                f"PythonExecutorTool limits too small (memory_mb {c['memory_mb']} >= 64, file_mb {c['file_mb']} "
                f">= 1, max_output_chars {c['max_output_chars']} >= 64): the interpreter itself would not fit"
            )
        if c["network_namespace"] == "required" and not network_prefix():
            raise ValueError(
                "config.network_namespace is 'required' but `unshare -rn` and `unshare -n` both fail here "
                "(no unshare, or user namespaces disabled); use 'auto' to run with the audit hook only"
            )

    async def call(self, arguments: dict[str, Any]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            raise ToolError('python: "code" must be a non-empty string of Python source')
        c = self.config
        prefix = () if c["network_namespace"] == "off" else await asyncio.to_thread(network_prefix)
        if c["network_namespace"] == "required" and not prefix:  # this process may run on another node
            raise ToolError("python: no network namespace on this node (unshare fails) and the tool requires one")
        run = await run_sandboxed(code, prefix, self.timeout_s, c["memory_mb"], c["file_mb"], c["max_output_chars"])
        return run.observation(self.timeout_s, c["max_output_chars"])


@dataclass
class BoundedReader:
    """Reads a stream to its end, keeping at most `cap` bytes (the head, or with `tail` the end)."""

    cap: int
    tail: bool = False
    data: bytearray = field(default_factory=bytearray)
    total: int = 0

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(1 << 16):
            self.total += len(chunk)
            if self.tail:
                self.data += chunk
                del self.data[: max(len(self.data) - self.cap, 0)]
            elif len(self.data) < self.cap:
                self.data += chunk[: self.cap - len(self.data)]

    def text(self, max_chars: int) -> str:
        """The kept bytes decoded, cut to max_chars; bytes never kept count as dropped chars."""
        return truncate(self.data.decode("utf-8", "replace"), max_chars, self.total - len(self.data), tail=self.tail)


@dataclass
class SandboxRun:
    """What one child did: exit status (None when killed at the wall timeout) and its bounded output."""

    returncode: int | None
    stdout: BoundedReader
    stderr: BoundedReader

    def observation(self, timeout_s: float, max_chars: int) -> str:
        """stdout on success; otherwise a ToolError with the stdout head and the stderr tail, within max_chars."""
        budget = max_chars - 80  # room for the runner's "Error: " and this message's first line
        if self.returncode == 0:
            return self.stdout.text(max_chars).rstrip("\n") or "(no output)"
        if self.returncode is None:
            head = f"the code ran over the time limit of {timeout_s:g} s and was killed"
        elif self.returncode < 0:
            sig = signal.Signals(-self.returncode)
            head = f"the code was stopped by {sig.name}: {SIGNALS.get(sig, 'killed by a signal')}"
        else:
            head = f"the code exited with status {self.returncode}"
        out = self.stdout.text(budget // 4) if self.stdout.total else ""
        err = self.stderr.text(budget - len(out)) if self.stderr.total else ""
        error = ToolTimeout if self.returncode is None else ToolError
        raise error("\n".join(part for part in (head, out and f"stdout:\n{out}", err) if part))


async def run_sandboxed(
    code: str, prefix: tuple[str, ...], timeout_s: float, memory_mb: int, file_mb: int, max_chars: int
) -> SandboxRun:
    """Run `code` in a sandboxed child (see the module docstring); the child is dead when this returns or
    is cancelled, and its temp dir removed."""
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="rlake_tool_"))
    try:
        Path(workdir, "main.py").write_text(code, encoding="utf-8")
        limits = {"memory_mb": memory_mb, "file_mb": file_mb, "cpu_s": math.ceil(timeout_s) + 1}
        limits["parent_pid"] = os.getpid()
        proc = await asyncio.create_subprocess_exec(
            *prefix, sys.executable, "-I", "-B", "-X", "utf8", CHILD, workdir, json.dumps(limits),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            cwd=workdir, env=_child_env(workdir), start_new_session=True,
        )  # fmt: skip
        out, err = BoundedReader(4 * max_chars), BoundedReader(4 * max_chars, tail=True)
        try:
            await asyncio.wait_for(
                asyncio.gather(out.drain(proc.stdout), err.drain(proc.stderr), proc.wait()), timeout_s
            )
            returncode = proc.returncode
        except TimeoutError:
            returncode = None
        finally:  # on timeout, cancellation or error: the whole process group goes
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(proc.wait(), 5)
        return SandboxRun(returncode, out, err)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _child_env(workdir: str) -> dict[str, str]:
    """A bare environment: no secrets, tokens or proxies of the trainer's; single-threaded math libraries."""
    threads = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    return {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8", **threads}


@lru_cache(maxsize=1)
def network_prefix() -> tuple[str, ...]:
    """The command prefix that starts the child in an empty network namespace (only a down loopback):
    `unshare -rn` (a user namespace too: works unprivileged where user namespaces are enabled), else
    `unshare -n` (needs CAP_SYS_ADMIN), else () when neither works here. Probed once per process."""
    exe = shutil.which("unshare")
    for flags in ("-rn", "-n"):
        if exe is None:
            break
        try:
            probe = subprocess.run([exe, flags, sys.executable, "-I", "-c", "pass"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return (exe, flags)
    return ()
