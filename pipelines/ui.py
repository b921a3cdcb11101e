"""`rlake ui`: Dagster's webserver and daemon (`dagster dev`) on a run's Dagster home, stopped cleanly.

Which runs it shows: those of the Dagster home of the config's trainer.output_dir (`<output_dir>/dagster_home`,
or DAGSTER_HOME when set), the config being `--config` plus `key.sub=value` overrides exactly as `rlake train`
takes them; `--run-dir DIR` is the override `trainer.output_dir=DIR` (for a run trained with that override).
The same config and overrides are the code location's launch-time default (RLAKE_CONFIG, RLAKE_OVERRIDES: a JSON
list, pipelines/definitions.py). The home's dagster.yaml gets telemetry and Dagster's "Join the Dagster
community" pop-up (`nux`) switched off, unless it says otherwise (pipelines/runner.py dagster_home).

Stopping: Ctrl-C (SIGINT) or SIGTERM to `rlake ui` is forwarded to the process group of `dagster dev` (its own
session: the webserver, the daemon and the code servers it starts are in it), which shuts its services down;
whatever of that tree is still running after STOP_TIMEOUT_S is killed, by pid. `dagster dev` alone, started
from a shell or process that ignores SIGINT (a background job of a script, many test runners), ignored both
signals: Python keeps an inherited SIG_IGN and Dagster maps SIGTERM to the SIGINT handler. Here the child
starts with both signals at their defaults (handlers this process installs are reset at exec).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from configs.errors import load_run_config

ROOT = Path(__file__).resolve().parent.parent
STOP_TIMEOUT_S = 60.0
"""How long `dagster dev` gets to stop its services after the forwarded signal before the tree is killed."""
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def ui_overrides(overrides: Sequence[str], run_dir: str | None) -> list[str]:
    """The overrides, then `trainer.output_dir=<run_dir>` (absolute) for --run-dir, which must be a directory."""
    out = list(overrides)
    if run_dir is not None:
        path = Path(run_dir).resolve()
        if not path.is_dir():
            raise FileNotFoundError(
                f"--run-dir '{run_dir}' is not a directory: it is the trainer.output_dir a run was trained with "
                "(it holds dagster_home/, tables/, checkpoints/); pass that directory"
            )
        out.append(f"trainer.output_dir={path}")
    return out


def ui_env(config: str, overrides: Sequence[str]) -> dict[str, str]:
    """The environment of `dagster dev` for a config path and its overrides (validated here, before Dagster)."""
    from pipelines.dagster_storage import dagster_home  # noqa: PLC0415 - imports Dagster

    cfg = load_run_config(config, overrides)
    return {
        **os.environ,
        "RLAKE_CONFIG": str(Path(config).resolve()),
        "RLAKE_OVERRIDES": json.dumps(list(overrides)),
        "DAGSTER_HOME": str(dagster_home(cfg.trainer.output_dir)),
    }


def dagster_dev_command(port: int, host: str = "127.0.0.1") -> list[str]:
    return [sys.executable, "-m", "dagster", "dev", "-w", str(ROOT / "workspace.yaml"), "-h", host, "-p", str(port)]


def serve(config: str, overrides: Sequence[str], *, port: int, stop_timeout_s: float = STOP_TIMEOUT_S) -> int:
    """Run `dagster dev` until it exits or this process gets SIGINT / SIGTERM (then stop its tree: stop_tree);
    returns its exit code, 0 when stopped by a signal."""
    env = ui_env(config, overrides)
    cmd = dagster_dev_command(port)
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: received.append(signum)) for sig in STOP_SIGNALS}
    try:
        print(f"starting: {' '.join(cmd)} (DAGSTER_HOME={env['DAGSTER_HOME']})", flush=True)
        print(f"Dagster UI: http://127.0.0.1:{port} (Ctrl-C stops it)", flush=True)
        proc = subprocess.Popen(cmd, env=env, cwd=os.getcwd(), start_new_session=True)
        while proc.poll() is None and not received:
            time.sleep(0.2)
        if proc.poll() is not None:
            return proc.returncode
        print(f"rlake ui: stopping Dagster (signal {received[0]}) ...", file=sys.stderr, flush=True)
        killed = stop_tree(proc, received[0], stop_timeout_s)
        if killed:
            print(f"rlake ui: killed pids {killed} after {stop_timeout_s:.0f} s", file=sys.stderr, flush=True)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_tree(proc: subprocess.Popen, sig: int, timeout_s: float) -> list[int]:
    """Send `sig` to `proc`'s process group, wait up to `timeout_s` for `proc` and every descendant it had, then
    SIGKILL the survivors (group and pids); returns the pids killed."""
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    _signal_group(proc.pid, sig)
    deadline = time.monotonic() + timeout_s
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    _, alive = psutil.wait_procs(descendants, timeout=max(0.0, deadline - time.monotonic()))
    killed = ([proc.pid] if proc.poll() is None else []) + [p.pid for p in alive]
    if killed:
        _signal_group(proc.pid, signal.SIGKILL)
        for p in alive:  # a descendant that left the group
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait(timeout=10)
        psutil.wait_procs(alive, timeout=10)
    return killed


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:  # the group is gone already
        pass
