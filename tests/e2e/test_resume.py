"""A real `rlake train` run SIGKILLed at several points, resumed with the same command, ends with the
same tables and weights as an uninterrupted run; a Delta writer killed mid-write leaves the table intact.

Kill points (one run, killed three times, then resumed to completion on ci_tiny, 2 iterations):
mid-generation of iteration 0, mid-update of iteration 0, and while (or right after) the update of
iteration 1 writes checkpoint policy_v2. Each kill takes the whole process group of the run (the
driver, its Ray head, raylet and workers) plus every descendant seen just before the kill. The uninterrupted
run is the session's shared ci_tiny run (the same config, trained once for several modules).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import psutil
import pytest
import torch

from stages.io import store

pytestmark = [pytest.mark.slow, pytest.mark.ray]
ROOT = Path(__file__).resolve().parents[2]
RUN = "R"
CMD = [sys.executable, "-m", "pipelines.cli", "train", "--config", "configs/ci_tiny.yaml", "--run-id", RUN]
METRIC_RTOL = 1e-5
"""Metrics of a resumed run equal the uninterrupted run's to this relative tolerance (timings excluded)."""
EXECUTION_METRICS = ("actor/weights_loaded_from_disk",)
"""How an iteration ran, not what it computed (a resumed update loads the policy from disk): not compared."""


def _launch(out: Path, cmd: list[str] = CMD) -> subprocess.Popen:
    """`cmd` (a `rlake train` command line) with output_dir `out`, in a new session, logging to <out>.log."""
    env = {k: v for k, v in os.environ.items() if k != "DAGSTER_HOME"}  # the run's own output_dir/dagster_home
    log = open(out.parent / f"{out.name}.log", "ab")
    return subprocess.Popen(
        cmd + [f"trainer.output_dir={out}"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _session_procs(sid: int) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                found.append(p)
        except (ProcessLookupError, psutil.Error, OSError):
            continue
    return found


def _kill_run(proc: subprocess.Popen) -> None:
    """SIGKILL the run's process group and every descendant (Ray may move some to other groups)."""
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        kids = []
    os.killpg(proc.pid, signal.SIGKILL)
    for k in kids + _session_procs(proc.pid):
        try:
            k.kill()
        except psutil.Error:
            pass
    proc.wait(timeout=30)
    psutil.wait_procs([k for k in kids if k.is_running()], timeout=10)
    left = [p for p in kids if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes of the killed run survive: {left}"


def _tail(out: Path) -> str:
    return (out.parent / f"{out.name}.log").read_text(errors="replace")[-3000:]


def _wait_until(proc: subprocess.Popen, out: Path, cond, what: str, timeout: float = 400, poll: float = 0.02):
    t0 = time.monotonic()
    while not cond():
        if proc.poll() is not None:
            pytest.fail(f"run exited (rc {proc.returncode}) before {what}:\n{_tail(out)}")
        if time.monotonic() - t0 > timeout:
            _kill_run(proc)
            pytest.fail(f"timed out waiting for {what}:\n{_tail(out)}")
        time.sleep(poll)


def _has(out: Path, table: str, it: int, run: str = RUN) -> bool:
    """Whether run `run`'s table `table` under `out` has rows of iteration `it` (False while it is being made)."""
    uri = str(out / "tables" / table)
    if not store.table_exists(uri):
        return False
    try:
        return len(store.read_partition(uri, run, it, columns=["iteration"])) > 0
    except (LookupError, OSError):
        return False


def _run_to_end(out: Path) -> None:
    proc = _launch(out)
    assert proc.wait(timeout=600) == 0, _tail(out)


@pytest.fixture(scope="module")
def reference(ci_tiny_pristine) -> tuple[Path, str]:
    """(output dir, run id) of the uninterrupted run: the session's shared ci_tiny run (tests/shared_run.py), read
    only. It is the same config and seed trained in-process under another run id; its tables, metrics and weights
    equal those of a `rlake train` subprocess of the same config exactly (checked when the subprocess reference
    it replaced was dropped: every rollout log-prob and metric identical, 2026-12-07)."""
    from tests.shared_run import RUN as SHARED_RUN

    return ci_tiny_pristine[0], SHARED_RUN


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory) -> tuple[Path, list[str]]:
    out = tmp_path_factory.mktemp("resume") / "killed"
    ckpts = out / "checkpoints" / RUN

    def part_dir(table: str, it: int) -> Callable[[], bool]:  # a stat per poll: the data file is being written
        return (out / "tables" / table / f"run_id={RUN}" / f"iteration={it}").is_dir

    def first_commit(table: str) -> Callable[[], bool]:  # a stat per poll: the table's first commit landed
        return (out / "tables" / table / "_delta_log" / "00000000000000000000.json").exists

    points = [
        ("mid-generation of iteration 0", part_dir("prompt_batches", 0), 0.0, lambda: not _has(out, "rollouts", 0)),
        # the advantages table's first commit: the update of iteration 0 starts right after it (a fixed delay
        # after its data file appeared no longer landed mid-update once the bookkeeping got faster)
        ("mid-update of iteration 0", first_commit("advantages"), 0.0, lambda: not _has(out, "iteration_metrics", 0)),
        (
            "checkpoint policy_v2 being written",
            lambda: (ckpts / "policy_v2.tmp").exists() or (ckpts / "policy_v2").exists(),
            0.0,
            lambda: not _has(out, "iteration_metrics", 1),
        ),
    ]
    hit = []
    for what, cond, delay, still_mid in points:
        proc = _launch(out)
        _wait_until(proc, out, cond, what)
        time.sleep(delay)
        tmp_seen = (ckpts / "policy_v2.tmp").exists()
        _kill_run(proc)
        assert still_mid(), f"the kill '{what}' came too late: that stage had already finished"
        hit.append(what + (" (policy_v2.tmp present)" if tmp_seen else ""))
    _run_to_end(out)
    return out, hit


def _frame(out: Path, table: str, it: int, sort: list[str], run: str = RUN) -> pd.DataFrame:
    return store.read_partition(str(out / "tables" / table), run, it).sort_values(sort).reset_index(drop=True)


def test_resumed_run_has_the_same_rows_order_and_values(reference, killed_and_resumed) -> None:
    out, hit = killed_and_resumed
    ref, ref_run = reference
    print("kill points hit:", hit)
    assert len(hit) == 3
    log = (out.parent / f"{out.name}.log").read_text(errors="replace")
    assert "resuming R (given run id) at iteration 1 from policy_v1" in log, log[-3000:]
    for it in (0, 1):
        a, b = _frame(ref, "prompt_batches", it, ["position"], ref_run), _frame(out, "prompt_batches", it, ["position"])
        assert a["prompt_id"].tolist() == b["prompt_id"].tolist() and a["epoch"].tolist() == b["epoch"].tolist()
        a, b = _frame(ref, "rollouts", it, ["rollout_id"], ref_run), _frame(out, "rollouts", it, ["rollout_id"])
        assert len(b) == 32 and b["rollout_id"].is_unique  # 8 prompts x 4 samples, no duplicates
        assert [list(x) for x in a["response_token_ids"]] == [list(x) for x in b["response_token_ids"]]
        assert a[["prompt_id", "sample_index"]].equals(b[["prompt_id", "sample_index"]])
        np.testing.assert_allclose(
            np.concatenate(a["rollout_logprobs"]), np.concatenate(b["rollout_logprobs"]), atol=1e-5
        )
        a, b = (
            _frame(ref, "scored_rollouts", it, ["rollout_id"], ref_run),
            _frame(out, "scored_rollouts", it, ["rollout_id"]),
        )
        assert a["reward"].tolist() == b["reward"].tolist()
        a, b = _frame(ref, "advantages", it, ["rollout_id"], ref_run), _frame(out, "advantages", it, ["rollout_id"])
        assert len(b) == 32
        np.testing.assert_allclose(a["advantage"], b["advantage"], atol=1e-6)
        a, b = (
            _frame(ref, "iteration_metrics", it, ["metric"], ref_run),
            _frame(out, "iteration_metrics", it, ["metric"]),
        )
        assert a["metric"].tolist() == b["metric"].tolist() and b["metric"].is_unique
        keep = (
            ~a["metric"].isin(EXECUTION_METRICS)
            & ~a["metric"].str.startswith(("timing_s/", "perf/"))
            & ~a["metric"].str.contains("per_s|_s$", regex=True)
        )
        np.testing.assert_allclose(
            a.loc[keep, "value"],
            b.loc[keep, "value"],
            rtol=METRIC_RTOL,
            atol=1e-7,
            err_msg=str(list(a.loc[keep, "metric"])),
        )


def test_resumed_run_ends_with_the_same_weights_and_no_partial_checkpoints(reference, killed_and_resumed) -> None:
    from stages.models.policy import load_policy
    from stages.run.resume import read_trainer_state

    out, _ = killed_and_resumed
    ref_out, ref_run = reference
    ref, _ = load_policy(ref_out / "checkpoints" / ref_run / "policy_v2")
    got, _ = load_policy(out / "checkpoints" / RUN / "policy_v2")
    for (name, a), b in zip(ref.state_dict().items(), got.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert not list((out / "checkpoints" / RUN).glob("*.tmp"))
    state = read_trainer_state(out / "checkpoints" / RUN / "policy_v2")
    assert state["iteration"] == 2 and state["data_cursor"]["position"] == 16


def test_dagster_runs_of_killed_processes_are_marked_failed(killed_and_resumed) -> None:
    import dagster as dg

    out, _ = killed_and_resumed
    instance = dg.DagsterInstance.from_config(str(out / "dagster_home"))
    statuses = [r.status for r in instance.get_runs(filters=dg.RunsFilter(tags={"rlake/run_id": RUN}))]
    assert dg.DagsterRunStatus.STARTED not in statuses and statuses.count(dg.DagsterRunStatus.FAILURE) == 3, statuses


def _kill_writer_mid_write(uri: Path, tmp_path: Path) -> tuple[int, int]:
    """Start a process writing a 3M-row partition; SIGKILL it as soon as its data file appears
    (staged as `<name>.parquet#N`, renamed, then committed). Returns (table version, rows of R/0)."""
    writer = (
        "import pandas as pd; from stages.io import store; n = 3_000_000\n"
        "df = pd.DataFrame({'policy_version': 1, 'metric': [f'x{i}' for i in range(n)], 'value': 2.0})\n"
        f"store.write_partition({str(uri)!r}, 'iteration_metrics', df, run_id='R', iteration=0, lineage={{}})\n"
    )
    part = uri / f"run_id={RUN}" / "iteration=0"
    before = set(os.listdir(part))
    proc = subprocess.Popen([sys.executable, "-c", writer], cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + 120
    while not set(os.listdir(part)) - before and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return store.table_version(str(uri)), len(store.read_partition(str(uri), RUN, 0))


def test_delta_writer_killed_mid_write_leaves_the_table_readable(tmp_path) -> None:
    """SIGKILL a process while it writes a big partition: the table holds the old rows or all new ones, never
    part; the orphan data file of the killed write is never read; a rewrite replaces the partition exactly."""
    uri = tmp_path / "iteration_metrics"
    small = pd.DataFrame({"policy_version": 0, "metric": [f"m{i}" for i in range(5)], "value": 1.0})
    store.write_partition(str(uri), "iteration_metrics", small, run_id=RUN, iteration=0, lineage={"stage": "t"})
    outcomes, old_version, old_rows = [], 0, 5
    for _ in range(4):  # the kill must land between the data file and the commit (~60 ms): retry a few times
        version, rows = _kill_writer_mid_write(uri, tmp_path)
        assert rows in (old_rows, 3_000_000), f"partial partition after a kill: {rows} rows"
        outcomes.append((version, rows))
        if version == old_version:
            break
        old_version, old_rows = version, rows
    assert outcomes[-1] == (old_version, old_rows), f"no kill landed before the commit: {outcomes}"
    orphans = [p for p in (uri / f"run_id={RUN}" / "iteration=0").iterdir()]
    assert len(orphans) >= 2  # the committed file and the killed write's file
    assert len(store.read_partition(str(uri), RUN, 0)) == old_rows
    store.write_partition(
        str(uri), "iteration_metrics", small.assign(value=3.0), run_id=RUN, iteration=0, lineage={"stage": "t"}
    )
    assert store.read_partition(str(uri), RUN, 0)["value"].tolist() == [3.0] * 5
