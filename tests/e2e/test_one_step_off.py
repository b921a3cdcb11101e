"""trainer.async_mode=one_step_off end to end on ci_tiny (3 iterations, real `rlake train` processes):

- every rollout row records the policy version that sampled it: v0, v0, v1 for iterations 0, 1, 2;
- the generation run of iteration i+1 and the training run of iteration i are two Dagster runs that were in
  flight at the same time, tagged with their phase and the policy version each used;
- the terminal still gets `rlake train`'s own lines after the overlapping runs (each run captures fds 1/2);
- a run SIGKILLed while iteration 2's generation runs beside iteration 1's update, then resumed with the same
  command, ends with the same rows, metrics and weights as the uninterrupted run;
- `rlake replay` of an update whose rollouts trail it reproduces the logged update.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from stages.io import store
from tests.e2e.test_resume import _has, _kill_run, _tail, _wait_until
from tests.e2e.test_resume import _launch as launch

pytestmark = [pytest.mark.slow, pytest.mark.ray]
ROOT = Path(__file__).resolve().parents[2]
RUN = "O"
CMD = [sys.executable, "-m", "pipelines.cli", "train", "--config", "configs/ci_tiny.yaml", "--run-id", RUN]
SETS = ["trainer.async_mode=one_step_off", "trainer.total_training_steps=3"]
EXPECTED_VERSIONS = {0: 0, 1: 0, 2: 1}


def _launch(out: Path) -> subprocess.Popen:
    return launch(out, CMD + SETS)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one_step_off") / "reference"
    assert _launch(out).wait(timeout=600) == 0, _tail(out)
    return out


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one_step_off") / "killed"
    proc = _launch(out)
    started = (out / "tables" / "prompt_batches" / f"run_id={RUN}" / "iteration=2").is_dir
    _wait_until(proc, out, started, "iteration 2's generation")
    _kill_run(proc)
    assert not _has(out, "iteration_metrics", 1, RUN), "the kill came too late: iteration 1's update had finished"
    assert _launch(out).wait(timeout=600) == 0, _tail(out)
    return out


def test_a_lost_trainer_is_retried_then_the_run_exits_with_the_resume_command(tmp_path) -> None:
    """one_step_off takes the same iteration retries as a sync run: the trainer group finds no capacity (a resource
    no node has) within ray.placement_timeout_s, so iteration 0 is re-run once from the last committed
    checkpoint, its rollouts generated again first, then `rlake train` exits 1 with the command that resumes."""
    out = tmp_path / "no_capacity"
    extra = [
        "ray.resources_per_worker={actor: {CPU: 1, rlake_test_absent: 1}}",
        "ray.placement_timeout_s=2",
        "trainer.max_iteration_retries=1",
    ]
    assert launch(out, [*CMD, *SETS, *extra]).wait(timeout=600) == 1, _tail(out)
    log = (tmp_path / "no_capacity.log").read_text(errors="replace")
    assert "iteration 0 lost a worker (PlacementTimeoutError: placement group rlake:O:actor" in log, log[-4000:]
    assert "retry 1 of trainer.max_iteration_retries=1" in log, log[-4000:]
    assert log.count("rollouts of iteration 0 (policy v0):") == 2, log[-4000:]  # regenerated before the re-run
    assert "lost a worker 2 times in a row (trainer.max_iteration_retries=1)" in log, log[-4000:]
    assert "rlake train --config <your config> --run-id O" in log, log[-4000:]


def _rows(out: Path, table: str, it: int, sort: str):
    return store.read_partition(str(out / "tables" / table), RUN, it).sort_values(sort).reset_index(drop=True)


def test_rows_commits_and_materializations_record_the_sampling_version(reference) -> None:
    import dagster as dg

    for it, version in EXPECTED_VERSIONS.items():
        rows = _rows(reference, "rollouts", it, "rollout_id")
        assert set(rows["policy_version"]) == {version}, it
    for it, version in EXPECTED_VERSIONS.items():  # newest commit of each partition: the Delta lineage
        commit = store.commit_lineage(str(reference / "tables" / "rollouts"), run_id=RUN, iteration=it)[0]
        assert int(commit["policy_version"]) == version
    instance = dg.DagsterInstance.from_config(str(reference / "dagster_home"))
    for it, version in EXPECTED_VERSIONS.items():  # and the Dagster materialization of each partition
        key = dg.MultiPartitionKey({"run": RUN, "iteration": str(it)})
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("rollouts"), asset_partitions=[str(key)]), limit=1
        ).records
        meta = records[0].asset_materialization.metadata
        assert meta["policy_version"].value == version and meta["policy_lag"].value == it - version


def test_generation_of_the_next_iteration_overlaps_the_update(reference) -> None:
    import dagster as dg

    instance = dg.DagsterInstance.from_config(str(reference / "dagster_home"))
    runs = {}
    for rec in instance.get_run_records(filters=dg.RunsFilter(tags={"rlake/run_id": RUN})):
        tags = rec.dagster_run.tags
        if "rlake/phase" in tags:
            it = int(tags["dagster/partition"].split("|")[0])
            runs[(tags["rlake/phase"], it)] = (rec.start_time, rec.end_time, int(tags["rlake/policy_version"]))
    assert {k: v[2] for k, v in runs.items()} == {
        ("generate", 0): 0,
        ("generate", 1): 0,
        ("generate", 2): 1,
        ("train", 0): 0,
        ("train", 1): 1,
        ("train", 2): 2,
    }
    for it in (1, 2):
        gen, train = runs[("generate", it)], runs[("train", it - 1)]
        assert gen[0] < train[1] and train[0] < gen[1], f"generation {it} did not overlap update {it - 1}: {runs}"
    log = (reference.parent / "reference.log").read_text(errors="replace")
    assert "done: 3 iterations" in log and "rollouts of iteration 2 (policy v1) beside the update" in log


def test_killed_mid_overlap_and_resumed_matches_the_uninterrupted_run(reference, killed_and_resumed) -> None:
    out = killed_and_resumed
    log = (out.parent / "killed.log").read_text(errors="replace")
    assert "resuming O (given run id) at iteration 1 from policy_v1" in log, log[-3000:]
    for it, version in EXPECTED_VERSIONS.items():
        a, b = _rows(reference, "rollouts", it, "rollout_id"), _rows(out, "rollouts", it, "rollout_id")
        assert set(b["policy_version"]) == {version}
        assert [list(x) for x in a["response_token_ids"]] == [list(x) for x in b["response_token_ids"]], it
        a, b = _rows(reference, "iteration_metrics", it, "metric"), _rows(out, "iteration_metrics", it, "metric")
        keep = ~a["metric"].str.startswith(("timing_s/", "perf/")) & ~a["metric"].str.contains("per_s|_s$|loaded_from")
        np.testing.assert_allclose(a.loc[keep, "value"], b.loc[keep, "value"], rtol=1e-5, atol=1e-7)
    from stages.models.policy import load_policy

    ref, _ = load_policy(reference / "checkpoints" / RUN / "policy_v3")
    got, _ = load_policy(out / "checkpoints" / RUN / "policy_v3")
    for (name, x), y in zip(ref.state_dict().items(), got.state_dict().values(), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=name)


def test_replay_of_an_update_whose_rollouts_trail(reference, tmp_path) -> None:
    """`rlake replay` of iteration 2 (rollouts from v1, update of v2) reproduces the logged update and v3."""
    cmd = [sys.executable, "-m", "pipelines.cli", "replay", "--config", "configs/ci_tiny.yaml", "--run-id", RUN]
    cmd += ["--iteration", "2", "--scratch", str(tmp_path / "scratch"), *SETS, f"trainer.output_dir={reference}"]
    env = {k: v for k, v in os.environ.items() if k != "DAGSTER_HOME"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "replay of run O iteration 2" in done.stdout and " NO" not in done.stdout, done.stdout
