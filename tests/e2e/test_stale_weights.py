"""Rollouts sampled from weights that never reached the engine (verl-project/verl#7495) stop the iteration.

A real ci_tiny run (Dagster in-process, local Ray, Delta): set-up and iteration 0 as usual; then every rollout
engine of the run's persistent rollout group is made to skip its next weight sync (its load_checkpoint and
load_state do nothing, inside the Ray actor), and iteration 1 runs. The engine still holds policy v1's predecessor,
so the rows' engine_weights_fingerprint differs from policy_v1's checkpoint: the blocking check
engine_weights_match_policy fails, and no stage after rollouts runs for that partition.
"""

from __future__ import annotations

import os

import dagster as dg
import pytest
import ray

from stages.io import store
from stages.io.checkpoints import ModelStore
from stages.workers.group import _find

pytestmark = [pytest.mark.slow, pytest.mark.ray]
CI = "configs/ci_tiny.yaml"
RUN = "stale-weights"


def _skip_weight_sync(worker) -> str:
    """Runs inside a RolloutWorker actor: its engine keeps whatever weights it holds from now on, whether they
    come from the checkpoint or from Ray's object store (rollout.weight_sync)."""
    worker.engine.load_checkpoint = lambda model_dir: None
    worker.engine.load_state = lambda state, source="": None
    return worker.engine.weights_fingerprint()


def test_an_engine_that_skipped_its_weight_sync_blocks_the_iteration(tmp_path, ray_session) -> None:
    from pipelines.runner import run_training

    os.environ["DAGSTER_HOME"] = str(tmp_path / "dagster_home")
    # no validation after iteration 0 (test_freq 0, 3 steps): it would move the engine to policy v1 before iteration 1
    overrides = [f"trainer.output_dir={tmp_path}", "trainer.total_training_steps=3", "trainer.test_freq=0"]
    try:
        run_training(CI, overrides, run_id=RUN, steps=1, log=lambda s: None)
        engines = _find("rollout")
        assert engines, "the run's rollout group should outlive the iteration (persistent workers)"
        held = {ray.get(a.__ray_call__.remote(_skip_weight_sync)) for a in engines}
        ms = ModelStore(tmp_path / "checkpoints", RUN)
        assert held == {ms.policy_fingerprint(0)}  # the engine holds the weights iteration 0 sampled with

        with pytest.raises(Exception) as failed:
            run_training(CI, overrides, run_id=RUN, steps=2, log=lambda s: None)
        assert "blocking asset check failed" in str(failed.value)

        instance = dg.DagsterInstance.get()
        (failed_run,) = instance.get_runs(
            filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.FAILURE], tags={"rlake/run_id": RUN})
        )
        assert failed_run.tags["dagster/partition"] == f"1|{RUN}"
        records = instance.get_records_for_run(
            failed_run.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION
        ).records
        found = [r.event_log_entry.dagster_event.event_specific_data for r in records]
        evaluations = {e.check_name: e for e in found}
        weights = evaluations["engine_weights_match_policy"]
        assert not weights.passed and weights.metadata["mismatched_rollouts"].value > 0
        assert weights.metadata["checkpoint_fingerprint"].value == ms.policy_fingerprint(1)
        assert evaluations["responses_nonempty"].passed
    finally:
        os.environ.pop("DAGSTER_HOME", None)

    rows = store.read_partition(str(tmp_path / "tables" / "rollouts"), RUN, 1)
    assert len(rows) > 0 and set(rows["engine_weights_fingerprint"]) == {ms.policy_fingerprint(0)}
    assert ms.policy_fingerprint(1) != ms.policy_fingerprint(0)
    # nothing downstream of the blocked rollouts was written for iteration 1
    for table in ("old_logprobs", "scored_rollouts", "advantages", "iteration_metrics"):
        assert store.commit_lineage(str(tmp_path / "tables" / table), run_id=RUN, iteration=1) == [], table
    assert 2 not in ms.versions()
