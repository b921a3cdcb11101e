"""The iteration DAG as one table: which stages a run has, in order, what each reads, and when it runs.

Each row is a Dagster asset of the same name (assets/*.py); a stage that writes a Delta table writes the
table of that name too (`rollouts` writes `rollouts`). The table drives the Definitions' asset list
(pipelines/definitions.py), the asset deps (`upstream`), the iteration job's selection
(pipelines/jobs.py), the timing metrics (assets/training.py) and the recorded-version look-up of an
upstream table (assets/common.py). `module` names the stage module that computes the asset.

SETUP runs once per run (rlake_setup_job); ITERATION once per iteration partition (rl_iteration_job),
a row only in runs where its `when` holds: the critic's stages with GAE, the reference log-probs with KL, the
teacher's with on-policy distillation.
The actor's recomputed log-probs of the rollouts (`old_logprobs`, verl's compute_log_prob) are in every run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from configs.schema import RunConfig


def always(cfg: RunConfig) -> bool:
    """Every run has this stage."""
    return True


def uses_critic(cfg: RunConfig) -> bool:
    """PPO with GAE: a critic scores the rollouts (`values`) and is trained (`critic_checkpoint`)."""
    return cfg.algorithm.adv_estimator == "gae"


def uses_reference(cfg: RunConfig) -> bool:
    """KL as a loss or in the reward: the reference policy's log-probs of the rollouts (`ref_logprobs`)."""
    return bool(cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)


def uses_teacher(cfg: RunConfig) -> bool:
    """On-policy distillation (algorithm.distillation.enable): the teacher's log-probs of the rollouts
    (`teacher_logprobs`)."""
    return bool(cfg.algorithm.distillation.enable)


def uses_multi_turn(cfg: RunConfig) -> bool:
    """Multi-turn tool-calling rollouts (rollout.multi_turn.enable): their turns, one row each (`turns`)."""
    return bool(cfg.rollout.multi_turn.enable)


def uses_judge(cfg: RunConfig) -> bool:
    """A generative judge scores the training rollouts (reward.judge): its verdicts (`judgements`)."""
    return bool(cfg.reward.judge.enable)


@dataclass(frozen=True)
class Stage:
    name: str
    """The asset's name; also the name of the Delta table it writes when `table`."""
    module: str
    """The stage module that computes it (stages/<module>.py): typed RunConfig + DataFrames in."""
    upstream: tuple[str, ...]
    """The stages it depends on (its Dagster asset deps)."""
    table: bool
    """It writes the Delta table `name` (else a checkpoint: policy_checkpoint, critic_checkpoint)."""
    timing: str | None = None
    """Its metric in iteration_metrics / MLflow (timing_s/<stage>, summed into timing_s/step); None: not timed.
    Names kept from before the table: timing_s/prompt_batch for prompt_batches, timing_s/update and
    timing_s/critic_update for the checkpoints (those two come from the update's own metrics)."""
    when: Callable[[RunConfig], bool] = always
    """Whether a run with this config has the stage (the iteration job selects it)."""


# fmt: off
SETUP: tuple[Stage, ...] = (
    #     name              module                   upstream
    Stage("prompts",        "stages.prompts",        (),           table=True),
    Stage("initial_policy", "stages.initial_policy", ("prompts",), table=False),
)
"""The run's set-up, once per run: the prompts table and policy version 0 (its validation goes to
iteration_metrics partition -1)."""

ITERATION: tuple[Stage, ...] = (
    #     name                 module                  upstream
    Stage("prompt_batches",    "stages.prompt_batches",  ("prompts", "initial_policy"),
          table=True,  timing="timing_s/prompt_batch"),
    Stage("rollouts",          "stages.rollouts",       ("prompt_batches",),
          table=True,  timing="timing_s/rollouts"),
    Stage("turns",             "stages.turns",         ("rollouts",),
          table=True,                                     when=uses_multi_turn),
    Stage("ref_logprobs",      "stages.ref_logprobs",  ("rollouts",),
          table=True,  timing="timing_s/ref_logprobs",    when=uses_reference),
    Stage("teacher_logprobs",  "stages.teacher_logprobs", ("rollouts",),
          table=True,  timing="timing_s/teacher_logprobs", when=uses_teacher),
    # the policy that sampled (version == iteration) is found like the rollouts' (ModelStore.require)
    Stage("old_logprobs",      "stages.old_logprobs",  ("rollouts",),
          table=True,  timing="timing_s/old_logprobs"),
    Stage("judgements",        "stages.judgements",         ("rollouts",),
          table=True,  timing="timing_s/judgements",      when=uses_judge),
    Stage("scored_rollouts",   "stages.scored_rollouts",        ("rollouts", "judgements"),
          table=True,  timing="timing_s/scored_rollouts"),
    Stage("values",            "stages.values",        ("scored_rollouts",),  # reads the rollouts table
          table=True,                                     when=uses_critic),
    Stage("advantages",        "stages.advantage_table",     ("scored_rollouts", "rollouts", "values", "ref_logprobs",
                                                        "teacher_logprobs", "old_logprobs"),
          table=True,  timing="timing_s/advantages"),
    Stage("policy_checkpoint", "stages.policy_checkpoint",        ("advantages",),
          table=False, timing="timing_s/update"),
    Stage("critic_checkpoint", "stages.critic_checkpoint", ("advantages", "values"),
          table=False, timing="timing_s/critic_update",   when=uses_critic),
    Stage("iteration_metrics", "stages.iteration_metrics",       ("policy_checkpoint", "critic_checkpoint"),
          table=True),
)
# fmt: on
"""One RL iteration, in execution order (a topological order of `upstream`)."""

STAGES: dict[str, Stage] = {s.name: s for s in SETUP + ITERATION}
TABLES: tuple[str, ...] = tuple(s.name for s in SETUP + ITERATION if s.table)
"""Every Delta table a stage writes (iteration_metrics also gets initial_policy's validation, partition -1)."""
STEP_TIMINGS: tuple[str, ...] = tuple(s.timing for s in ITERATION if s.timing)
"""The timing metrics timing_s/step adds up."""


def upstream(name: str) -> list[str]:
    """The asset deps of stage `name` (for its @dg.asset decorator)."""
    return list(STAGES[name].upstream)


def iteration_stages(cfg: RunConfig | None = None) -> list[str]:
    """The names of the iteration stages a run with `cfg` has, in order (None: the stages every run has)."""
    return [s.name for s in ITERATION if (s.when(cfg) if cfg is not None else s.when is always)]
