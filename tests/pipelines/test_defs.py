"""The one Definitions loads, every job resolves, the graph is the designed DAG (stages/dag.py), the sensor chains."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

from configs.schema import load_config
from pipelines.definitions import ASSETS, build_definitions
from pipelines.jobs import ITERATION_JOB, SETUP_JOB, iteration_assets
from pipelines.sensors import next_iteration
from stages import dag

CI = "configs/ci_tiny.yaml"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def defs() -> dg.Definitions:
    return build_definitions(load_config(CI))


def _selected(*overrides: str) -> set[str]:
    """The iteration assets a launch of this config materializes (rlake train and the sensor select them)."""
    return set(iteration_assets(load_config(CI, list(overrides))))


def test_definitions_load_and_jobs_resolve(defs) -> None:
    for name in (SETUP_JOB, ITERATION_JOB):
        assert defs.resolve_job_def(name).name == name
    assert [a.key.to_user_string() for a in ASSETS] == [
        "prompts",
        "initial_policy",
        "prompt_batches",
        "rollouts",
        "turns",
        "ref_logprobs",
        "teacher_logprobs",
        "old_logprobs",
        "judgements",
        "scored_rollouts",
        "values",
        "advantages",
        "policy_checkpoint",
        "critic_checkpoint",
        "iteration_metrics",
    ]
    assert set(defs.resources) == {"run_config", "ray", "rollout_store", "model_store", "tracker", "delta_io"}


def test_asset_graph_is_the_iteration_dag(defs) -> None:
    graph = defs.resolve_asset_graph()
    up = {
        k.to_user_string(): {p.to_user_string() for p in graph.get(k).parent_keys} for k in graph.get_all_asset_keys()
    }
    assert up["rollouts"] == {"prompt_batches"}
    assert up["scored_rollouts"] == {"rollouts", "judgements"} and up["judgements"] == {"rollouts"}
    assert up["old_logprobs"] == {"rollouts"} and up["turns"] == {"rollouts"}
    assert up["advantages"] == {
        "scored_rollouts",
        "rollouts",
        "values",
        "ref_logprobs",
        "teacher_logprobs",
        "old_logprobs",
    }
    assert up["teacher_logprobs"] == {"rollouts"}
    assert up["values"] == {"rollouts", "scored_rollouts"} and up["critic_checkpoint"] == {"advantages", "values"}
    assert up["policy_checkpoint"] == {"advantages"}
    assert up["iteration_metrics"] == {"policy_checkpoint", "critic_checkpoint"}
    checks = {c.name for c in graph.asset_check_keys}
    assert {"responses_nonempty", "rewards_finite", "advantages_finite"} <= checks


def test_the_dag_table_drives_assets_deps_jobs_and_timings(defs) -> None:
    """Every asset is a row of stages/dag.py and its Dagster deps are the row's upstream; rows are in a
    topological order, and carry the timing metric names users see. One stage = one asset = one name: the row's
    compute function is in stages/<name>.py, the asset's body in assets/<name>.py, and the asset's inputs are the
    upstream stages that write tables, loaded by the one Delta IO manager."""
    graph = defs.resolve_asset_graph()
    rows = dag.SETUP + dag.ITERATION
    assert {k.to_user_string() for k in graph.get_all_asset_keys()} == {s.name for s in rows}
    seen: set[str] = set()
    for s in rows:
        assert {p.to_user_string() for p in graph.get(dg.AssetKey(s.name)).parent_keys} == set(s.upstream), s.name
        assert set(s.upstream) <= seen, f"{s.name} comes before its upstream {set(s.upstream) - seen}"
        assert callable(getattr(importlib.import_module(f"stages.{s.name}"), s.compute)), s.name
        assert callable(importlib.import_module(f"assets.{s.name}").materialize), s.name
        asset = graph.get(dg.AssetKey(s.name)).assets_def
        managers = {k.to_user_string(): asset.node_def.input_def_named(n).input_manager_key
                    for n, k in asset.keys_by_input_name.items()}  # fmt: skip
        assert {u for u, m in managers.items() if m == "delta_io"} == set(s.inputs), s.name
        assert set(s.inputs) == {u for u in s.upstream if dag.STAGES[u].table}, s.name
        seen.add(s.name)
    assert dag.STEP_TIMINGS == (
        "timing_s/prompt_batch",
        "timing_s/rollouts",
        "timing_s/ref_logprobs",
        "timing_s/teacher_logprobs",
        "timing_s/old_logprobs",
        "timing_s/judgements",
        "timing_s/scored_rollouts",
        "timing_s/advantages",
        "timing_s/update",
        "timing_s/critic_update",
    )
    assert dag.TABLES == (
        "prompts",
        "prompt_batches",
        "rollouts",
        "turns",
        "ref_logprobs",
        "teacher_logprobs",
        "old_logprobs",
        "judgements",
        "scored_rollouts",
        "values",
        "advantages",
        "iteration_metrics",
    )
    assert iteration_assets() == [
        "prompt_batches",
        "rollouts",
        "old_logprobs",
        "scored_rollouts",
        "advantages",
        "policy_checkpoint",
        "iteration_metrics",
    ]


def test_iteration_job_runs_the_critic_only_for_gae_and_the_reference_only_with_kl() -> None:
    assert not {"values", "critic_checkpoint", "ref_logprobs", "judgements", "turns"} & _selected()
    mt = ("rollout.multi_turn.enable=true", "rollout.multi_turn.tool_config_path=configs/tools/calculator.yaml")
    assert "turns" in _selected(*mt)
    assert {"values", "critic_checkpoint"} <= _selected("algorithm.adv_estimator=gae")
    assert "ref_logprobs" in _selected("actor.use_kl_loss=true")
    assert "judgements" in _selected("reward.judge.enable=true", "reward.judge.model_path=/any")
    teacher = ("algorithm.distillation.enable=true", "algorithm.distillation.teacher_model_path=/any")
    assert "teacher_logprobs" in _selected(*teacher) and "teacher_logprobs" not in _selected()


def test_the_iteration_job_holds_every_stage_whatever_the_load_time_config() -> None:
    """The launched config, not the code location's, decides which stages run (jobs.py)."""
    for overrides in ((), ("algorithm.adv_estimator=gae", "actor.use_kl_loss=true")):
        job = build_definitions(load_config(CI, list(overrides))).resolve_job_def(ITERATION_JOB)
        assert {k.to_user_string() for k in job.asset_layer.selected_asset_keys} == {s.name for s in dag.ITERATION}


def test_build_definitions_takes_a_config(tmp_path) -> None:
    cfg = load_config(CI, [f"trainer.output_dir={tmp_path}", "trainer.run_id=given"])
    d = build_definitions(cfg)
    with dg.build_resources(d.resources) as res:
        assert res.rollout_store.root == str(tmp_path / "tables")
        assert res.model_store.root == str(tmp_path / "checkpoints")
        assert res.tracker.tracking_uri == f"sqlite:///{tmp_path / 'mlflow.db'}"
        assert res.run_config.load() == cfg


def test_launch_time_config_reaches_every_resource(tmp_path) -> None:
    """A launch-time config (the launchpad's resources.run_config) replaces the load-time one for every
    resource of the run, not just run_config."""
    d = build_definitions(config_path=str(ROOT / CI), overrides=[f"trainer.output_dir={tmp_path / 'a'}"])
    launched = {"run_config": {"config": {"overrides": [f"trainer.output_dir={tmp_path / 'b'}", "rollout.n=8"]}}}
    with dg.build_resources(d.resources, resource_config=launched) as res:
        assert res.rollout_store.root == str(tmp_path / "b" / "tables")
        assert res.tracker.tracking_uri == f"sqlite:///{tmp_path / 'b' / 'mlflow.db'}"
        assert res.run_config.load().rollout.n == 8


def test_a_bad_launch_config_fails_with_what_why_fix() -> None:
    from assets.resources import resolve_run_config

    with pytest.raises(ValueError, match=r"unknown config key 'rollout.nn'.*did you mean 'rollout.n'"):
        resolve_run_config("", str(ROOT / CI), ["rollout.nn=2"])
    with pytest.raises(ValueError, match=r"trainer.run_id='a'.*partition run='b'.*drop trainer.run_id"):
        resolve_run_config("", str(ROOT / CI), ["trainer.run_id=a"], run_id="b")
    with pytest.raises(ValueError, match=r"config_path 'nope.yaml' does not exist.*absolute path"):
        resolve_run_config("", "nope.yaml", [])
    assert resolve_run_config("", str(ROOT / CI), [], run_id="b").run_id == "b"


def test_run_config_resource_parses_its_json_once_per_process() -> None:
    from assets.resources import RunConfigResource

    cfg = load_config(CI, ["trainer.run_id=json"])
    res = RunConfigResource(config_json=cfg.model_dump_json(indent=1))  # as a fresh run process gets it
    parsed = res.load()
    assert parsed == cfg and parsed.config_hash() == cfg.config_hash() and parsed.run_id == "json"
    assert RunConfigResource(config_json=cfg.model_dump_json(indent=1)).load() is parsed


def test_importing_the_definitions_module_builds_nothing() -> None:
    """`import pipelines.definitions` parses no config (only `defs()`, the dagster dev entry point, does)."""
    code = (
        "import configs.schema as s\n"
        "calls = []\n"
        "orig = s.load_config\n"
        "s.load_config = lambda *a, **k: calls.append(a) or orig(*a, **k)\n"
        "import pipelines.definitions as d\n"
        "assert calls == [], calls\n"
        "import dagster as dg\n"
        "assert not isinstance(d.defs, dg.Definitions)\n"
        "built = d.defs()\n"
        "assert isinstance(built, dg.Definitions) and len(calls) == 1, calls\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RLAKE_CONFIG", "RLAKE_OVERRIDES", "RL_ENV")}
    env |= {"RLAKE_CONFIG": str(ROOT / CI), "RLAKE_OVERRIDES": "trainer.run_id=ui;trainer.total_training_steps=5"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def test_next_iteration_chain() -> None:
    assert next_iteration(SETUP_JOB, None, 3) == 0
    assert next_iteration(ITERATION_JOB, "0", 3) == 1
    assert next_iteration(ITERATION_JOB, "2", 3) is None
    assert next_iteration("other_job", "0", 3) is None


def _sensor_result(tmp_path, instance, run_config: dict, tags: dict, asset_selection=None):
    d = build_definitions(config_path=str(ROOT / CI), overrides=[f"trainer.output_dir={tmp_path}"])
    sensor = d.get_sensor_def("next_iteration_sensor")
    job = d.resolve_job_def(ITERATION_JOB)
    if asset_selection is not None:
        job = job.get_subset(asset_selection=set(asset_selection))
    run = instance.create_run_for_job(job, tags=tags, run_config=run_config, asset_selection=asset_selection)
    ctx = dg.build_run_status_sensor_context(
        sensor_name=sensor.name, dagster_instance=instance, dagster_run=run, dagster_event=_success_event(run)
    )
    return sensor(ctx)


def test_sensor_launches_the_next_iteration_of_the_same_run_with_the_launched_config(tmp_path) -> None:
    """Evaluate the real run-status sensor against a real (ephemeral) instance and a finished run that was
    launched with a launch-time config change (rollout.n, and GAE: the critic's stages)."""
    launched = {"resources": {"run_config": {"config": {"overrides": ["rollout.n=8", "algorithm.adv_estimator=gae"]}}}}
    tags = {"dagster/partition": "0|run-a", "dagster/partition/run": "run-a", "dagster/partition/iteration": "0"}
    with dg.instance_for_test(temp_dir=str(tmp_path)) as instance:
        result = _sensor_result(tmp_path, instance, launched, tags)
        assert isinstance(result, dg.RunRequest)
        assert result.partition_key == "1|run-a" and result.run_config == launched
        assert [k.to_user_string() for k in result.asset_selection] == iteration_assets(
            load_config(CI, ["algorithm.adv_estimator=gae"])
        )
        assert "values" in {k.to_user_string() for k in result.asset_selection}
        assert result.tags["rlake/run_id"] == "run-a" and result.tags["rlake/driver"] == "sensor"
        assert "1" in instance.get_dynamic_partitions("iteration") and "run-a" in instance.get_dynamic_partitions("run")
        # the launched config's total_training_steps, not the load-time one, ends the chain
        short = {"resources": {"run_config": {"config": {"overrides": ["trainer.total_training_steps=1"]}}}}
        assert isinstance(_sensor_result(tmp_path, instance, short, tags), dg.SkipReason)


def test_sensor_does_not_chain_after_a_partial_rematerialization(tmp_path) -> None:
    tags = {"dagster/partition/run": "r", "dagster/partition/iteration": "0"}
    with dg.instance_for_test(temp_dir=str(tmp_path)) as instance:
        result = _sensor_result(
            tmp_path, instance, {}, tags, asset_selection=frozenset({dg.AssetKey("scored_rollouts")})
        )
        assert isinstance(result, dg.SkipReason) and "re-score" in result.skip_message


def test_sensor_leaves_runs_of_rlake_train_alone(tmp_path) -> None:
    tags = {"dagster/partition/run": "r", "dagster/partition/iteration": "0", "rlake/driver": "cli"}
    with dg.instance_for_test(temp_dir=str(tmp_path)) as instance:
        result = _sensor_result(tmp_path, instance, {}, tags)
        assert isinstance(result, dg.SkipReason) and "rlake CLI" in result.skip_message


def _success_event(run):
    return dg.DagsterEvent(
        event_type_value=dg.DagsterEventType.RUN_SUCCESS.value, job_name=run.job_name, message="done"
    )
