"""`rlake ui` on a trained run (issue #35): `--run-dir` opens the run trained with `trainer.output_dir=DIR` (its
runs, assets and partitions over the webserver's GraphQL API), without Dagster's community pop-up, and SIGTERM
stops the whole process tree (dagster dev, webserver, daemon, code servers), checked by pid."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from pipelines.cli import main
from stages.io.ports import free_port
from tests.shared_run import RUN

ROOT = Path(__file__).resolve().parents[2]


def _gql(port: int, query: str) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/graphql",
        method="POST",
        data=json.dumps({"query": query}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        body = json.loads(resp.read())
    assert "errors" not in body, body
    return body["data"]


def _wait_up(port: int, proc: subprocess.Popen, log: Path, timeout_s: float = 240) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        assert proc.poll() is None, f"rlake ui exited {proc.returncode}: {log.read_text()[-3000:]}"
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=2)
            return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"the webserver did not answer in {timeout_s} s: {log.read_text()[-3000:]}")


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def test_ui_refuses_a_run_dir_that_does_not_exist(tmp_path, capsys) -> None:
    assert main(["ui", "--run-dir", str(tmp_path / "nope")]) == 2
    assert "--run-dir" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.ray
def test_ui_opens_a_run_dir_and_sigterm_stops_the_whole_tree(ci_tiny_run, tmp_path) -> None:
    out, summary = ci_tiny_run
    # each iteration_metrics partition carries its own run's curves (the UI's Plots tab mixes runs on one axis)
    assert summary["iterations"][-1]["run_curves"].startswith(f"![curves of run {RUN}](data:image/png;base64,")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "RLAKE_CONFIG", "RLAKE_OVERRIDES")}
    cmd = [sys.executable, "-m", "pipelines.cli", "ui", "--config", "configs/ci_tiny.yaml", "--run-dir", str(out)]
    log = tmp_path / "ui.log"
    with open(log, "w") as f:  # its own session: the test can clean up by group if the command fails to
        ui = subprocess.Popen(
            [*cmd, "--port", str(port)], cwd=ROOT, env=env, stdout=f, stderr=f, start_new_session=True
        )
    tree: list[int] = []
    procs: list[psutil.Process] = []
    try:
        _wait_up(port, ui, log)
        assert _gql(port, "{ shouldShowNux }")["shouldShowNux"] is False  # no "Join the Dagster community"
        mats = _gql(
            port,
            """{ assetOrError(assetKey: {path: ["iteration_metrics"]}) { ... on Asset {
              assetMaterializations(limit: 20) { partition } } } }""",
        )["assetOrError"]["assetMaterializations"]
        assert {f"0|{RUN}", f"1|{RUN}"} <= {m["partition"] for m in mats}  # the run trained into --run-dir
        query = '{ runsOrError(filter: {tags: [{key: "rlake/run_id", value: "RUN"}]}) '
        query += "{ ... on Runs { results { status } } } }"
        runs = _gql(port, query.replace("RUN", RUN))["runsOrError"]["results"]
        assert [r["status"] for r in runs] == ["SUCCESS"] * 3  # its set-up and 2 iterations
        procs = psutil.Process(ui.pid).children(recursive=True)
        tree = [p.pid for p in procs]
        assert len(tree) >= 3, tree  # dagster dev, its webserver and daemon (and code servers)

        ui.send_signal(signal.SIGTERM)  # to `rlake ui` alone, as a service manager or `kill` sends it
        assert ui.wait(timeout=120) == 0, log.read_text()[-3000:]
        deadline = time.time() + 30
        while _alive(tree) and time.time() < deadline:
            time.sleep(0.5)
        assert _alive(tree) == [], f"left running: {_alive(tree)}; {log.read_text()[-3000:]}"
        assert "killed pids" not in log.read_text()  # Dagster stopped its own services within the timeout
    finally:  # only after a failure is anything left: this test's processes, by pid (psutil checks pid reuse)
        if ui.poll() is None:
            os.killpg(ui.pid, signal.SIGKILL)
        for p in procs:
            if p.is_running():
                p.kill()
        ui.wait(timeout=30)
