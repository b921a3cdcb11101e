"""A run launched the way the Dagster UI launches it (the code location's lazy `defs`, jobs executed by
Dagster, no pipelines/runner.py) leaves the same trainer_state.json next to each checkpoint as `rlake train`:
the assets that write policy_v0 and policy_v<N+1> write it."""

from __future__ import annotations

import json

import dagster as dg
import pytest

from configs.schema import load_config
from pipelines.jobs import ITERATION_JOB, SETUP_JOB
from stages.io import store
from stages.run.resume import read_trainer_state, trainer_state

pytestmark = [pytest.mark.slow, pytest.mark.ray]
CI = "configs/ci_tiny.yaml"
RUN = "ui-run"


def test_a_ui_launched_run_writes_trainer_state(tmp_path, monkeypatch, ray_session) -> None:
    import pipelines.definitions

    overrides = [f"trainer.output_dir={tmp_path / 'out'}"]  # the partition names the run
    monkeypatch.setenv("RLAKE_CONFIG", CI)
    monkeypatch.setenv("RLAKE_OVERRIDES", ";".join(overrides))
    defs = pipelines.definitions.defs()  # what `dagster dev -w workspace.yaml` loads
    (tmp_path / "dagster_home").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster_home")) as instance:
        instance.add_dynamic_partitions("run", [RUN])
        assert defs.resolve_job_def(SETUP_JOB).execute_in_process(instance=instance, partition_key=RUN).success
        instance.add_dynamic_partitions("iteration", ["0"])
        key = dg.MultiPartitionKey({"run": RUN, "iteration": "0"})
        assert defs.resolve_job_def(ITERATION_JOB).execute_in_process(instance=instance, partition_key=key).success

    cfg = load_config(CI, [*overrides, f"trainer.run_id={RUN}"])
    prompts = store.read_partition(str(tmp_path / "out" / "tables" / "prompts"), RUN, -1, columns=["split"])
    n_train = int((prompts["split"] == "train").sum())
    ckpts = tmp_path / "out" / "checkpoints" / RUN
    for version in (0, 1):
        state = read_trainer_state(ckpts / f"policy_v{version}")
        assert state == json.loads(json.dumps(trainer_state(cfg, RUN, version, n_train))), version
    assert read_trainer_state(ckpts / "policy_v1")["data_cursor"]["position"] == cfg.data.train_batch_size
