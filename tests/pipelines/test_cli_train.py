"""`rlake train` as a user sees it: a live display on a terminal, framework noise in a log file."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from pipelines.dagster_storage import instance_yaml
from pipelines.progress import RunProgress
from pipelines.runner import NUX_OFF, TELEMETRY_OFF, dagster_home

ROOT = Path(__file__).resolve().parents[2]
NOISE = (
    "Telemetry",
    "Welcome to Dagster",
    "RayDeprecationWarning",
    "Token authentication",
    " INFO ",
    "streaming_executor",
    "Warning:",
)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")


def _run_in_terminal(cmd: list[str], env: dict, timeout: float = 600) -> tuple[int, str]:
    """Run cmd with stdout/stderr on a pseudo-terminal (as in a shell); returns (exit code, output).

    Reads with select so neither a silent child nor a grandchild that keeps the terminal open after
    the child exited (a Ray worker) can block the test; the child is killed after `timeout`."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        cmd, stdout=slave, stderr=slave, stdin=subprocess.DEVNULL, cwd=ROOT, env=env, start_new_session=True
    )
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # every writer closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        else:
            proc.kill()
    finally:
        os.close(master)
    return proc.wait(timeout=60), b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_train_on_a_terminal_shows_progress_and_keeps_noise_in_the_log(tmp_path: Path) -> None:
    env = {**os.environ, "COLUMNS": "200", "DAGSTER_HOME": str(tmp_path / "dagster_home")}
    code, out = _run_in_terminal(
        [
            sys.executable,
            "-m",
            "pipelines.cli",
            "train",
            "--config",
            "configs/ci_tiny.yaml",
            f"trainer.output_dir={tmp_path}",
            "--run-id",
            "tty",
        ],
        env,
    )
    text = ANSI.sub("\n", out)
    assert code == 0, text[-3000:]
    assert "iteration 0:" in text and "iteration 1:" in text and "done: 2 iterations" in text
    stages = ("prompt_batches", "rollouts", "scored_rollouts", "advantages", "policy_checkpoint", "iteration_metrics")
    assert any(s in text for s in stages), "the live display names the running stage"
    assert "tok/s=" in text and "reward=" in text  # stats from the rollouts / scored_rollouts materializations
    noise = [line for line in text.splitlines() if any(n in line for n in NOISE)]
    assert not noise, noise[:5]
    (log_file,) = (tmp_path / "logs").glob("train-*.log")
    assert "mlflow" in log_file.read_text()  # MLflow's database set-up lines went here instead
    assert "enabled: false" in (tmp_path / "dagster_home" / "dagster.yaml").read_text()


def test_plain_progress_prints_phases_and_iteration_lines() -> None:
    lines: list[str] = []
    progress = RunProgress(live=False, log=lines.append)
    with progress:
        progress.phase("preflight", "data and model inputs")
        progress.start_iterations(0, 3)
        progress.iteration_done(0, 4.0, "critic/score/mean=0.5")
        progress.iteration_done(1, 2.0, "critic/score/mean=0.6")
    assert lines == [
        "  preflight: data and model inputs",
        "iteration 0: 4.0s  critic/score/mean=0.5",
        "iteration 1: 2.0s  critic/score/mean=0.6",
    ]
    assert progress.eta() == "ETA 0:03"  # one left x mean(4, 2) s


def test_live_progress_renders_stage_and_stats_on_a_terminal() -> None:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=200)
    with RunProgress(console=console) as progress:
        progress.start_iterations(0, 2)
        progress._update(stage="rollouts", stats="tok/s=812 reward=0.531")
        progress._bar.refresh()
        progress.iteration_done(0, 3.0, "critic/score/mean=0.531")
    text = ANSI.sub("", buf.getvalue())
    assert "rollouts" in text and "tok/s=812" in text and "iteration 0: 3.0s" in text


def test_dagster_home_switches_telemetry_and_the_community_pop_up_off_once(tmp_path: Path, monkeypatch) -> None:
    import dagster as dg

    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    home = dagster_home(str(tmp_path / "linux"))  # 'nux' in the path is not the key
    assert (home / "dagster.yaml").read_text() == TELEMETRY_OFF + NUX_OFF + instance_yaml(home)
    dagster_home(str(tmp_path / "linux"))
    assert (home / "dagster.yaml").read_text() == TELEMETRY_OFF + NUX_OFF + instance_yaml(home)  # not twice
    with dg.DagsterInstance.from_config(str(home)) as instance:  # the UI's "Join the Dagster community" pop-up
        assert not instance.nux_enabled and not instance.telemetry_enabled
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: true\nnux:\n  enabled: true\n")
    dagster_home(str(tmp_path / "linux"))
    assert (home / "dagster.yaml").read_text().count("enabled: true") == 2  # a user's own choices stay
