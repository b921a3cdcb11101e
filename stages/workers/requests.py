"""What the stages send to the workers: frozen dataclasses, built in the driver, pickled to every rank.

A request names its inputs by storage location (a Delta table at a version, a committed checkpoint by its
reference or, in tests and exports, a local directory),
never by a live object, so a replay or a retried call reads exactly what the first attempt read.
`stages.policy_checkpoint.update_request` is the one place an UpdateRequest is built from the run config (the
policy_checkpoint asset and `rlake replay` both use it); `stages.critic_checkpoint.critic_update_request`
builds the critic's.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from configs.schema import ActorConfig, CriticConfig, RolloutCorrectionConfig
from stages.workers.placement import CPU_ONLY, GpuPool


@dataclass(frozen=True)
class UpdateRequest:
    """One policy update (verl: `update_actor`): iteration `iteration`'s rows of the advantages table at
    `advantages_version`, applied to the checkpoint `policy_dir`, written to `out_dir`."""

    run_id: str
    iteration: int
    advantages_uri: str
    advantages_version: int
    policy_dir: str
    """The input checkpoint, policy version `iteration` (HF format, optimizer state beside it from v1 on): a
    checkpoint reference (ModelStore.require) or a local directory (stages.io.checkpoints.resolve_model_dir)."""
    out_dir: str
    """Where rank 0 writes policy version iteration + 1: a checkpoint_target (committed to the run's store) or a
    local directory (written atomically; stages.io.checkpoints.writing)."""
    actor: ActorConfig
    n_per_prompt: int
    """rollout.n: a mini-batch of actor.ppo_mini_batch_size prompts holds this many rollouts per prompt."""
    seed: int
    """stages.seeds.update(cfg.seed, iteration): mini-batch order and the ranks' torch RNG."""
    temperature: float = 1.0
    """Logits are divided by it for old/new log-probs and the entropy (stages.train.batching.logprob_temperature)."""
    checkpoint_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """Written beside the new checkpoint; a rank holding it resident skips the next load."""
    threads_per_worker: int | None = None
    """torch threads of each rank; None: the Ray cluster's CPUs split over actor.num_workers ranks."""
    gpus: GpuPool = CPU_ONLY
    """The run's GPU pool (GpuPool.of(cfg.trainer)): rank i trains on GPU i; the default is a CPU run."""
    rollout_correction: RolloutCorrectionConfig = RolloutCorrectionConfig()
    """algorithm.rollout_correction: engine-vs-trainer importance weights / rejection in the policy loss (off)."""
    weight_sync: str = "storage"
    """rollout.weight_sync: "object_store" has rank 0 also put the new weights in Ray's object store
    (ActorWorker.published_weights), where the rollout engines take them without a file."""
    extra_files: tuple[tuple[str, str], ...] = ()
    """(name, text) files committed with the new checkpoint (its trainer_state.json, stages.run.resume)."""


@dataclass(frozen=True)
class CriticUpdateRequest:
    """One critic update (verl: `update_critic`): critic version `iteration` at `critic_dir` trained towards
    the iteration's GAE returns, written as version iteration + 1 to `out_dir`."""

    iteration: int
    critic_dir: str
    """Critic version `iteration`: a checkpoint reference or a local directory."""
    out_dir: str
    """Where critic version iteration + 1 goes: a checkpoint_target or a local directory (as UpdateRequest's)."""
    critic: CriticConfig
    n_per_prompt: int
    seed: int
    """stages.seeds.update(cfg.seed, iteration), as the policy update's."""
    run_id: str
    advantages_uri: str
    """The advantages table (its GAE returns) the critic rank reads, at advantages_version."""
    advantages_version: int
    values_uri: str
    """The values table (the rollout-time values the loss clips against), at values_version."""
    values_version: int
