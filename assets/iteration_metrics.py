"""The iteration_metrics asset: verl-named metrics of the iteration, to Delta and MLflow
(stages/iteration_metrics.py)."""

import dagster as dg
import pandas as pd

from assets.common import Background, checkpoint_metrics, read_recorded, recorded_version, timed
from assets.resources import RolloutStoreResource, TrackerResource
from assets.stage_assets import StageRun
from configs.schema import RunConfig
from stages.dag import ITERATION, uses_critic
from stages.evaluate import validation_rollouts, validation_summary
from stages.io import uris
from stages.io.plots import run_curves_markdown
from stages.io.store import commit_at, newest_commit, pinned
from stages.io.tables import PROMPTS_ITERATION
from stages.io.tracking import is_tracking_server
from stages.iteration_metrics import validates
from stages.models.policy import load_tokenizer
from stages.scored_tokens import ScoredRollouts
from stages.workers.group import worker_placements


def materialize(run: StageRun) -> dg.MaterializeResult:
    """verl-named metrics of the iteration (+ validation every test_freq), to Delta and MLflow. Its tables are
    done when it runs: each is looked up once (stages.io.store.pinned), not once per read. Once the metrics are
    measured, the MLflow calls (in the order they were always made) and the `workers` write run on threads of their
    own while the step writes its table and draws `run_curves`; it returns once all are done, failing with the
    first error (assets.common.Background). Only when MLflow or the tables are remote: with sqlite and local files
    there is nothing to wait on, and the threads would only contend for the GIL."""
    cfg, it, tracker, store = run.cfg, run.iteration, run.tracker, run.rollout_store
    remote = is_tracking_server(tracker.tracking_uri) or not uris.is_local(store.root)
    with pinned(), Background(threads=remote) as bg:
        m, val, read_versions = measure_iteration(run)
        mlflow_id = bg.submit("mlflow", log_step, tracker, cfg, m, step=it + 1)
        rows = pd.DataFrame({"policy_version": it + 1, "metric": list(m), "value": list(m.values())})
        v = run.write(rows, upstream=read_versions, policy_version=it + 1, duration_s=0.0)
        lineage = {"metrics_version": v, "policy_version": it + 1, "validation": val}
        bg.submit("mlflow", tracker.log_iteration, mlflow_id, store.location, cfg.run_id, it, **lineage)
        run.ray.ensure()  # where the run's workers are now (the recorded placement; SQL over the `workers` table)
        bg.submit("workers", write_placements, run)
        if it + 1 == cfg.trainer.total_training_steps:  # the run is complete: its validation curve, then FINISHED
            bg.submit("mlflow", tracker.end_run, cfg.run_id, "FINISHED", tables_root=store.location)
        curves = run_curves_markdown(store.location, cfg.run_id)
    return run.result(
        v,
        {
            **{k: m[k] for k in SUMMARY_METRICS if k in m},
            **{k: x for k, x in m.items() if k.startswith("val-core/")},
            "run_curves": dg.MetadataValue.md(curves),
        },
    )


def log_step(tracker: TrackerResource, cfg: RunConfig, metrics: dict[str, float], *, step: int) -> str:
    """The MLflow run of the rlake run (reopened / its last step set: TrackerResource.run_for), with the iteration's
    metrics logged at `step`; returns its id."""
    mlflow_id = tracker.run_for(cfg.run_id, cfg, step=step)
    tracker.log_metrics(mlflow_id, metrics, step=step)
    return mlflow_id


def write_placements(run: StageRun) -> None:
    """The iteration's rows of the `workers` table: one per live named worker of the run (worker_placements)."""
    placed = pd.DataFrame(worker_placements(run.cfg.run_id))
    if len(placed):
        policy_version = run.iteration + 1
        run.write(placed, upstream={}, policy_version=policy_version, table="workers", duration_s=0.0, stage="workers")


def measure_iteration(run: StageRun) -> tuple[dict[str, float], dict | None, dict]:
    """(the iteration's metrics, its validation rollouts or None, the table versions read): the iteration_metrics
    stage over the iteration's recorded partitions, the updates' recorded metrics, the stages' timings and, when
    it validates, the validation of the new policy."""
    cfg, it, store = run.cfg, run.iteration, run.rollout_store
    rollouts = run.partition("rollouts")  # the token columns
    scored = ScoredRollouts(run.partition("scored_rollouts"), rollouts)
    adv = run.partition("advantages")
    values = run.partition("values") if uses_critic(cfg) else None  # the values partition streamed like the others
    ms = run.model_store.for_run(cfg.run_id)
    new_dir = ms.require(it + 1, needed_by="iteration_metrics")
    update, c_v = checkpoint_metrics(store, cfg.run_id, it, "policy", it + 1)
    critic = checkpoint_metrics(store, cfg.run_id, it, "critic", it + 1)[0] if values is not None else None
    timings = stage_timings(store, cfg.run_id, it, instance=run.context.instance, cfg=cfg)
    m = run.compute(scored, adv, update_metrics=update, timings=timings, values=values, critic_update_metrics=critic)
    val, val_metrics = validation(run, new_dir)
    read_versions = {"scored_rollouts": scored.version, "rollouts": rollouts.version, "advantages": adv.version}
    read_versions["checkpoints"] = c_v
    return m | val_metrics, val, read_versions


def validation(run: StageRun, new_dir) -> tuple[dict | None, dict[str, float]]:
    """(validation rollouts by sampling mode, their val-core metrics and timing_s/testing: the seconds it took)
    when iteration `it`'s new policy is validated (stages.iteration_metrics.validates), else (None, {})."""
    cfg, it = run.cfg, run.iteration
    if not validates(cfg, it):
        return None, {}
    with timed() as t:
        run.ray.ensure()
        prompts, _ = read_recorded(run.context, run.rollout_store, "prompts", cfg.run_id, PROMPTS_ITERATION)
        tok = load_tokenizer(run.model_store.for_run(cfg.run_id).fetch_tokenizer(it + 1))
        val = validation_rollouts(str(new_dir), prompts[prompts["split"] == "val"], tok, cfg)
        summary = validation_summary(val)
    return val, {**summary, "timing_s/testing": t["s"]}


SUMMARY_METRICS = (
    "critic/score/mean",
    "critic/vf_loss",
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/entropy",
    "actor/ppo_kl",
    "actor/kl_loss",
    "actor/reward_kl_penalty",
    "actor/teacher_kl",
    "training/rollout_probs_diff_mean",
    "response_length/mean",
    "timing_s/step",
)
"""The iteration_metrics asset's metadata (Dagster UI, plotted across partitions on the asset's Plots tab, every
run's partitions on one axis), besides val-core/* and `run_curves` (the curves of the partition's run alone, up
to that iteration: stages.io.plots.run_curves_markdown); every metric goes to Delta and MLflow."""


def stage_timings(
    rollout_store: RolloutStoreResource,
    run_id: str,
    it: int,
    *,
    instance: dg.DagsterInstance | None = None,
    cfg: RunConfig | None = None,
) -> dict[str, float]:
    """The timing metric (stages/dag.py) of each timed stage that writes a table, from the duration in the lineage
    commit of its table for this iteration: with `instance`, the commit its asset's latest materialization recorded
    (assets.common.recorded_version: the commit file alone, no table opened; on S3 no LIST), else (or when none
    is recorded) the newest (read down to that commit only: store.newest_commit); the updates report theirs in
    their own metrics. With `cfg`, only the stages the run has (a stage's `when`): one the run does not have is
    not looked up (a Dagster query and, on S3, a LIST for its absent table, each iteration)."""
    out = {}
    for stage in (s for s in ITERATION if s.table and s.timing and (cfg is None or s.when(cfg))):
        uri = rollout_store.uri(stage.name)
        version = None if instance is None else recorded_version(instance, uri, stage.name, run_id, it)
        commit = commit_at(uri, version) if version is not None else newest_commit(uri, run_id, it)
        if commit is not None:  # ref_logprobs: only in runs with KL
            out[stage.timing] = float(commit["duration_s"])
    return out
