"""How an `rlake` process ends (pipelines/cli.py exit_now): the command's exit status, with everything the
interpreter's own exit would have done before its teardown: other threads joined, atexit handlers run, buffered
output flushed. A test calling main(argv) gets the status back instead."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from pipelines.cli import main

ROOT = Path(__file__).resolve().parents[2]
CI = str(ROOT / "configs" / "ci_tiny.yaml")

SCRIPT = textwrap.dedent("""
    import atexit, sys, threading, time
    from pipelines import cli

    def late():
        time.sleep(0.5)
        sys.stdout.write("thread finished\\n")  # buffered (a pipe): flushed by the exit

    threading.Thread(target=late).start()  # not a daemon: the exit waits for it
    atexit.register(lambda: sys.stdout.write("atexit handler ran\\n"))
    sys.argv = ["rlake", *sys.argv[1:]]
    cli.main()
    print("not reached: main() ends the process")
""")


def _rlake(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_command_that_succeeds_exits_0_after_threads_and_atexit_handlers() -> None:
    done = _rlake("config", "--config", CI, "trainer.run_id=exit-test")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "trainer.run_id: exit-test" in lines  # the command's own output, flushed
    assert lines[-2:] == ["thread finished", "atexit handler ran"], lines[-5:]
    assert "not reached" not in done.stdout


def test_a_bad_config_exits_2_with_its_message() -> None:
    done = _rlake("config", "--config", CI, "trainer.no_such_key=1")
    assert done.returncode == 2, (done.stdout[-2000:], done.stderr[-2000:])
    assert "no_such_key" in done.stderr and "atexit handler ran" in done.stdout


def test_main_with_arguments_returns_the_status(capsys) -> None:
    assert main(["config", "--config", CI, "trainer.run_id=in-process"]) == 0
    assert "trainer.run_id: in-process" in capsys.readouterr().out
