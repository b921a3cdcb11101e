"""The pieces of trainer.async_mode=one_step_off that need no training run (the run itself:
tests/e2e/test_one_step_off.py): the version schedule, the phase split, the refused GPU config, the
engine-vs-trainer gap check, and two overlapping Dagster runs' stdout capture on a real compute log manager."""

from __future__ import annotations

import os
import sys
import threading

import dagster as dg
import pytest
from pydantic import ValidationError

from assets.old_logprobs import probs_gap_check
from configs.schema import TrainerConfig, load_config
from pipelines.jobs import iteration_assets
from pipelines.one_step_off import GENERATION, phase_selections, serialized_capture


def test_sampling_version_trails_by_one_update() -> None:
    sync, off = TrainerConfig(), TrainerConfig(async_mode="one_step_off")
    assert [sync.rollout_version(i) for i in range(4)] == [0, 1, 2, 3] and sync.policy_lag == 0
    assert [off.rollout_version(i) for i in range(4)] == [0, 0, 1, 2] and off.policy_lag == 1


def test_gpu_pool_is_refused_with_the_reason() -> None:
    with pytest.raises(ValidationError, match="colocates every role on the GPU pool"):
        TrainerConfig(async_mode="one_step_off", n_gpus_per_node=1)


@pytest.mark.parametrize("config", ["configs/ci_tiny.yaml", "configs/ppo.yaml", "configs/ci_tiny_tools.yaml"])
def test_phases_split_every_stage_of_the_iteration_once(config) -> None:
    cfg = load_config(config)
    gen, train = phase_selections(cfg)
    names = [k.path[-1] for k in gen + train]
    assert sorted(names) == sorted(iteration_assets(cfg))
    assert [k.path[-1] for k in gen] == [n for n in iteration_assets(cfg) if n in GENERATION]
    assert "rollouts" in [k.path[-1] for k in gen] and "policy_checkpoint" in [k.path[-1] for k in train]


def test_gap_check_is_recorded_not_judged_when_the_rollouts_trail() -> None:
    gap = {"training/rollout_probs_diff_mean": 0.04, "training/rollout_probs_diff_max": 0.5}
    assert not probs_gap_check(gap, 0.02).passed  # sync: a 0.04 gap warns
    lagged = probs_gap_check(gap, 0.02, lag=1)
    assert lagged.passed and "trail the trainer by 1" in lagged.metadata["skipped"].value
    assert lagged.metadata["rollout_probs_diff_mean"].value == 0.04


def _fd1_target() -> str:
    return os.readlink(f"/proc/self/fd/{sys.stdout.fileno()}")


def test_overlapping_captures_leave_stdout_where_it_was(tmp_path) -> None:
    """Run a starts capturing, run b starts, a ends, b ends (overlapping, not nested, as a generation run beside
    a training run does): fd 1 ends where it was. Dagster's manager alone would leave it on a's log file (b
    restores what it saved when it started: a's redirect)."""
    from dagster._core.storage.local_compute_log_manager import LocalComputeLogManager

    manager = LocalComputeLogManager(str(tmp_path / "logs"))
    capture = serialized_capture(manager)
    before = _fd1_target()
    a_in, b_in = threading.Event(), threading.Event()

    def run_a() -> None:
        with capture(["run-a", "compute_logs", "a"]):
            a_in.set()
            b_in.wait(30)
            os.write(sys.stdout.fileno(), b"from a\n")

    thread = threading.Thread(target=run_a)
    thread.start()
    assert a_in.wait(30)
    with capture(["run-b", "compute_logs", "b"]):
        b_in.set()
        thread.join(30)  # a ends while b is still running
    assert _fd1_target() == before
    a_out = manager.get_captured_local_path(["run-a", "compute_logs", "a"], "out")
    b_out = manager.get_captured_local_path(["run-b", "compute_logs", "b"], "out")
    assert "from a" in open(a_out).read()
    assert "overlapped run log run-a/compute_logs/a" in open(b_out).read()
    assert manager.is_capture_complete(["run-b", "compute_logs", "b"])


def test_concurrent_runs_reuse_the_handlers_built_once(tmp_path) -> None:
    from pipelines.one_step_off import concurrent_runs

    with dg.instance_for_test(temp_dir=str(tmp_path)) as instance:
        calls = []
        original = instance.get_yaml_python_handlers
        instance.get_yaml_python_handlers = lambda: calls.append(1) or original()
        with concurrent_runs(instance):
            first, second = instance.get_yaml_python_handlers(), instance.get_yaml_python_handlers()
            assert first is second and calls == [1]
