"""The child side of PythonExecutorTool: `python -I -B sandbox_child.py <workdir> <limits json>`.

Before the user's code (workdir/main.py) runs, this sets the resource limits (soft = hard, so the code
cannot raise them), asks the kernel to SIGKILL it when the tool process dies, and installs an audit hook
(PEP 578) that raises PermissionError on: sockets, new processes (subprocess, os.system, os.exec*,
os.fork, os.posix_spawn), signals to other processes, ctypes calls, and writes (open for w/a/x/+, os.remove,
os.rename, os.mkdir, ...) outside workdir. Audit hooks stop accidents, not an adversary: code can still
read any file this user can, and tricks below the Python level are out of their reach (docs/tools.md).
Standard library only: this file runs in a bare interpreter.
"""

from __future__ import annotations

import _posixsubprocess  # subprocess's fork+exec: called without an audit event, so main() disarms it
import ctypes  # imported before the audit hook, which blocks ctypes calls
import json
import linecache
import os
import resource
import signal
import sys
import traceback

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
BLOCKED_EVENTS = {
    "os.system": "running a shell command",
    "os.exec": "starting a program",
    "os.posix_spawn": "starting a program",
    "os.spawn": "starting a program",
    "os.fork": "forking",
    "os.forkpty": "forking",
    "subprocess.Popen": "starting a program",
    "pty.spawn": "starting a program",
    "os.kill": "signalling a process",
    "os.killpg": "signalling a process",
    "ctypes.dlsym": "calling C functions",
    "ctypes.dlsym/handle": "calling C functions",
    "ctypes.call_function": "calling C functions",
    "ctypes.cdata": "reading raw memory",
}
PATH_EVENTS = {  # event -> (index of a path it changes, index of that path's dir_fd or None), ...
    "os.remove": ((0, 1),),
    "os.rmdir": ((0, 1),),
    "os.mkdir": ((0, 2),),
    "os.rename": ((0, 2), (1, 3)),
    "os.link": ((0, 2), (1, 3)),
    "os.symlink": ((1, 2),),
    "os.chmod": ((0, 2),),
    "os.chown": ((0, 3),),
    "os.chflags": ((0, None),),
    "os.lchflags": ((0, None),),
    "os.truncate": ((0, None),),
    "os.utime": ((0, 3),),
    "os.setxattr": ((0, None),),
    "os.removexattr": ((0, None),),
    "shutil.rmtree": ((0, 1),),
}


def main() -> None:
    workdir, limits = os.path.realpath(sys.argv[1]), json.loads(sys.argv[2])
    _set_limits(limits)
    _die_with_parent(limits["parent_pid"])
    _posixsubprocess.fork_exec = _refuse
    sys.addaudithook(_hook(workdir))
    with open(os.path.join(workdir, "main.py"), encoding="utf-8") as f:
        source = f.read()
    # a fixed file name, so the same code gives the same traceback text in every call (no temp dir path)
    linecache.cache["main.py"] = (len(source), None, source.splitlines(True), "main.py")
    scope = {"__name__": "__main__", "__builtins__": __builtins__, "__file__": "main.py"}
    try:
        exec(compile(source, "main.py", "exec"), scope)
    except SystemExit:
        raise
    except BaseException as exc:
        te = traceback.TracebackException.from_exception(exc)
        _drop_sandbox_frames(te)
        sys.stderr.write("".join(te.format()))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _drop_sandbox_frames(te: traceback.TracebackException | None) -> None:
    """Leave this file's frames (exec, the audit hook) out of `te` and the exceptions chained to it."""
    seen = set()
    while te is not None and id(te) not in seen:
        seen.add(id(te))
        te.stack = traceback.StackSummary.from_list([f for f in te.stack if f.filename != __file__])
        te = te.__cause__ or te.__context__


def _set_limits(limits: dict) -> None:
    mb = 1024 * 1024
    for name, value in (
        ("RLIMIT_AS", limits["memory_mb"] * mb),
        ("RLIMIT_DATA", limits["memory_mb"] * mb),
        ("RLIMIT_CPU", limits["cpu_s"]),
        ("RLIMIT_FSIZE", limits["file_mb"] * mb),
        ("RLIMIT_NOFILE", 64),
        ("RLIMIT_CORE", 0),
    ):
        resource.setrlimit(getattr(resource, name), (value, value))


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the tool's process dies (a Ray task cancelled with force, a crash): set here,
    not in a preexec_fn, because entering a user namespace (unshare -r) clears the setting."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    if os.getppid() != parent_pid:  # the parent died before prctl
        os._exit(137)


def _refuse(*args, **kwargs):
    raise PermissionError("sandbox: starting a program is not allowed")


def _hook(workdir: str):
    def inside(path, dir_fd=None) -> bool:
        if isinstance(path, int):  # an fd: checked when it was opened
            return True
        base = os.readlink(f"/proc/self/fd/{dir_fd}") if isinstance(dir_fd, int) and dir_fd >= 0 else os.getcwd()
        real = os.path.realpath(os.path.join(base, os.fsdecode(path)))
        return real == workdir or real.startswith(workdir + os.sep) or real == os.devnull

    def hook(event: str, args: tuple) -> None:
        if event in BLOCKED_EVENTS or event.startswith("socket."):
            what = BLOCKED_EVENTS.get(event, "network access")
            raise PermissionError(f"sandbox: {what} is not allowed ({event})")
        if event == "import" and args[0] in ("_posixsubprocess", "_ctypes"):
            raise PermissionError(f"sandbox: re-importing {args[0]} is not allowed")
        if event == "open" and args[2] & WRITE_FLAGS:
            if args[1] is None and not isinstance(args[0], int) and not os.path.isabs(os.fsdecode(args[0])):
                # os.open may take a dir_fd the event does not show
                raise PermissionError(f"sandbox: os.open({args[0]!r}) for writing needs an absolute path")
            if not inside(args[0]):
                raise PermissionError(f"sandbox: writing {args[0]!r} outside the working directory is not allowed")
        for i, j in PATH_EVENTS.get(event, ()):
            if not inside(args[i], args[j] if j is not None and j < len(args) else None):
                raise PermissionError(f"sandbox: {event} on {args[i]!r} outside the working directory is not allowed")

    return hook


if __name__ == "__main__":
    main()
