"""The iteration DAG as one table: which stages a run has, in order, what each reads, and when it runs.

Each row is one stage = one Dagster asset = one module pair, all of the same name: the asset is generated from
its row (assets/stage_assets.py: partitions, group, kinds, checks, inputs), its body is `materialize` in
assets/<name>.py, and `compute` names the function of stages/<name>.py that does the work. A stage that
writes a Delta table writes the table of that name (`rollouts` writes `rollouts`); the stages it reads are its
inputs, loaded as partition handles at their recorded versions by the one Delta IO manager
(assets/delta_io.py). The table also drives the iteration job's selection (pipelines/jobs.py) and the timing
metrics (assets/iteration_metrics.py).

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


DATA, ROLLOUT, TRAIN, EVAL = "DATA", "ROLLOUT", "TRAIN", "EVAL"
"""The asset groups of the Dagster UI."""


@dataclass(frozen=True)
class Check:
    """An asset check of a stage: its result comes from the asset's body (assets/<stage>.py)."""

    name: str
    blocking: bool = True
    """A failed check stops the downstream stages of the iteration."""
    description: str = ""


@dataclass(frozen=True)
class Stage:
    name: str
    """The asset's name; the Delta table it writes when `table`; its modules assets/<name>.py and
    stages/<name>.py."""
    compute: str
    """The name of the stage's compute function in stages/<name>.py: what the asset's body (the `materialize`
    of assets/<name>.py) runs on its inputs."""
    upstream: tuple[str, ...]
    """The stages it depends on. Those that write a table are its inputs, loaded by the Delta IO manager as
    partition handles at the version their asset recorded (assets/delta_io.py); the others are plain deps."""
    table: bool
    """It writes the Delta table `name` (else a checkpoint: initial_policy, policy_checkpoint, critic_checkpoint)."""
    group: str
    """Its asset group in the UI (DATA, ROLLOUT, TRAIN, EVAL)."""
    kinds: tuple[str, ...]
    """Its kinds in the UI (what it runs on and writes)."""
    timing: str | None = None
    """Its metric in iteration_metrics / MLflow (timing_s/<stage>, summed into timing_s/step); None: not timed.
    Names kept from before the table: timing_s/prompt_batch for prompt_batches, timing_s/update and
    timing_s/critic_update for the checkpoints (those two come from the update's own metrics)."""
    when: Callable[[RunConfig], bool] = always
    """Whether a run with this config has the stage (the iteration job selects it)."""
    checks: tuple[Check, ...] = ()
    """Its asset checks."""

    @property
    def inputs(self) -> tuple[str, ...]:
        """The upstream stages whose tables it reads (its Dagster inputs)."""
        return tuple(u for u in self.upstream if STAGES[u].table)


_WEIGHTS = (
    "every rollout's engine_weights_fingerprint == the fingerprint of the policy checkpoint that should have "
    "generated it (weights that never reached the engine stop the iteration)"
)
_PROBS = "training/rollout_probs_diff_mean <= trainer.max_rollout_probs_diff_mean (warn; null: off)"
_RAY, _TORCH, _DELTA = "ray", "pytorch", "delta"

# fmt: off
SETUP: tuple[Stage, ...] = (
    Stage("prompts", "build_prompt_rows", (),
          table=True, group=DATA, kinds=(_DELTA,)),
    Stage("initial_policy", "create_initial_policy", ("prompts",),
          table=False, group=TRAIN, kinds=(_TORCH,)),
)
"""The run's set-up, once per run: the prompts table and policy version 0 (its validation goes to
iteration_metrics partition -1)."""

ITERATION: tuple[Stage, ...] = (
    Stage("prompt_batches", "build_prompt_batch", ("prompts", "initial_policy"),
          table=True, group=ROLLOUT, kinds=(_DELTA,), timing="timing_s/prompt_batch"),
    Stage("rollouts", "sample_rollouts", ("prompt_batches",),
          table=True, group=ROLLOUT, kinds=(_RAY, _DELTA), timing="timing_s/rollouts",
          checks=(Check("responses_nonempty"), Check("engine_weights_match_policy", description=_WEIGHTS))),
    Stage("turns", "turns_table", ("rollouts",),
          table=True, group=ROLLOUT, kinds=(_DELTA,), when=uses_multi_turn),
    Stage("ref_logprobs", "reference_logprobs", ("rollouts",),
          table=True, group=ROLLOUT, kinds=(_RAY, _TORCH, _DELTA), timing="timing_s/ref_logprobs",
          when=uses_reference),
    Stage("teacher_logprobs", "teacher_logprobs", ("rollouts",),
          table=True, group=ROLLOUT, kinds=(_RAY, _TORCH, _DELTA), timing="timing_s/teacher_logprobs",
          when=uses_teacher),
    # the policy that sampled (version == iteration) is found like the rollouts' (ModelStore.require)
    Stage("old_logprobs", "policy_old_logprobs", ("rollouts",),
          table=True, group=TRAIN, kinds=(_RAY, _TORCH, _DELTA), timing="timing_s/old_logprobs",
          checks=(Check("rollout_probs_diff_within_limit", blocking=False, description=_PROBS),)),
    Stage("judgements", "judge_rollouts", ("rollouts",),
          table=True, group=ROLLOUT, kinds=(_RAY, _DELTA), timing="timing_s/judgements", when=uses_judge),
    Stage("scored_rollouts", "score_partition", ("rollouts", "judgements"),
          table=True, group=ROLLOUT, kinds=(_RAY, _DELTA), timing="timing_s/scored_rollouts",
          checks=(Check("rewards_finite"),)),
    # reads the rollouts; after scored_rollouts so that a failed reward stops the iteration before the critic
    Stage("values", "rollout_values", ("rollouts", "scored_rollouts"),
          table=True, group=TRAIN, kinds=(_TORCH, _DELTA), when=uses_critic, checks=(Check("values_finite"),)),
    Stage("advantages", "stream_advantages",
          ("scored_rollouts", "rollouts", "values", "ref_logprobs", "teacher_logprobs", "old_logprobs"),
          table=True, group=TRAIN, kinds=(_TORCH, _DELTA), timing="timing_s/advantages",
          checks=(Check("advantages_finite"),)),
    Stage("policy_checkpoint", "run_update", ("advantages",),
          table=False, group=TRAIN, kinds=(_RAY, _TORCH), timing="timing_s/update",
          checks=(Check("ppo_kl_within_limit", description="|actor/ppo_kl| <= trainer.max_ppo_kl (null: off)"),)),
    Stage("critic_checkpoint", "train_critic", ("advantages", "values"),
          table=False, group=TRAIN, kinds=(_TORCH,), timing="timing_s/critic_update", when=uses_critic),
    Stage("iteration_metrics", "iteration_metrics",
          ("policy_checkpoint", "critic_checkpoint"),
          table=True, group=EVAL, kinds=(_DELTA, "mlflow")),
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
