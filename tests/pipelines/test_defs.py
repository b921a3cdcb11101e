"""The one Definitions loads, every job resolves, the graph is the designed DAG, the sensor chains."""
from __future__ import annotations

import dagster as dg

from pipelines.definitions import ASSETS, build_definitions, defs
from pipelines.jobs import ITERATION_JOB, SETUP_JOB
from pipelines.sensors import next_iteration


def test_definitions_load_and_jobs_resolve() -> None:
    for name in (SETUP_JOB, ITERATION_JOB):
        assert defs.resolve_job_def(name).name == name
    assert {a.key.to_user_string() for a in ASSETS} == {
        "prompts", "initial_policy", "prompt_batch", "rollouts", "scored_rollouts", "advantages",
        "policy_checkpoint", "iteration_metrics", "values", "critic_checkpoint", "ref_logprobs"}
    assert set(defs.resources) == {"run_config", "ray", "rollout_store", "model_store", "tracker"}


def test_asset_graph_is_the_iteration_dag() -> None:
    graph = defs.resolve_asset_graph()
    up = {k.to_user_string(): {p.to_user_string() for p in graph.get(k).parent_keys} for k in graph.get_all_asset_keys()}
    assert up["rollouts"] == {"prompt_batch"}
    assert up["scored_rollouts"] == {"rollouts"}
    assert up["advantages"] == {"scored_rollouts", "values", "ref_logprobs"}
    assert up["values"] == {"scored_rollouts"} and up["critic_checkpoint"] == {"advantages", "values"}
    assert up["policy_checkpoint"] == {"advantages"}
    assert up["iteration_metrics"] == {"policy_checkpoint", "critic_checkpoint"}
    checks = {c.name for c in graph.asset_check_keys}
    assert {"responses_nonempty", "rewards_finite", "advantages_finite"} <= checks


def test_iteration_job_runs_the_critic_only_for_gae() -> None:
    def selected(*overrides: str) -> set[str]:
        job = build_definitions("configs/ci_tiny.yaml", list(overrides)).resolve_job_def(ITERATION_JOB)
        return {k.to_user_string() for k in job.asset_layer.selected_asset_keys}
    assert not {"values", "critic_checkpoint"} & selected()
    assert {"values", "critic_checkpoint"} <= selected("algorithm.adv_estimator=gae")


def test_build_definitions_takes_a_config(tmp_path) -> None:
    d = build_definitions("configs/ci_tiny.yaml", [f"trainer.output_dir={tmp_path}"])
    assert d.resources["rollout_store"].root == str(tmp_path / "tables")
    assert d.resources["tracker"].tracking_uri == f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_next_iteration_chain() -> None:
    assert next_iteration(SETUP_JOB, None, 3) == 0
    assert next_iteration(ITERATION_JOB, "0", 3) == 1
    assert next_iteration(ITERATION_JOB, "2", 3) is None
    assert next_iteration("other_job", "0", 3) is None


def test_sensor_requests_next_partition(tmp_path) -> None:
    """Evaluate the real run-status sensor against a real (ephemeral) instance and a finished run."""
    with dg.instance_for_test(temp_dir=str(tmp_path)) as instance:
        d = build_definitions("configs/ci_tiny.yaml", [f"trainer.output_dir={tmp_path}"])
        sensor = d.get_sensor_def("next_iteration_sensor")
        run = instance.create_run_for_job(d.resolve_job_def(ITERATION_JOB), tags={"dagster/partition": "0"})
        ctx = dg.build_run_status_sensor_context(sensor_name=sensor.name, dagster_instance=instance,
                                                 dagster_run=run, dagster_event=_success_event(run))
        result = sensor(ctx)
        assert isinstance(result, dg.RunRequest) and result.partition_key == "1"
        assert "1" in instance.get_dynamic_partitions("iteration")


def _success_event(run):
    return dg.DagsterEvent(event_type_value=dg.DagsterEventType.RUN_SUCCESS.value, job_name=run.job_name,
                           message="done")
