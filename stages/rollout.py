"""The rollouts stage: each prompt of the iteration's batch -> rollout.n sampled responses, with
prompt and response token ids, per-token logprobs and finish reason (plus DAPO rounds and ReMax's
greedy baselines, see `sample_rollouts`).

Flow: assets/rollout.py `rollouts` -> `sample_rollouts(batch, cfg=...)` -> `generate_rollouts`, which
splits the batch into contiguous shards over the run's "rollout" worker group and calls
`RolloutWorker.generate` (stages/workers/rollout_worker.py) on each rank. The workers keep their engine
for the whole run and take each new policy version's weights in place.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import pandas as pd
import ray
from ray.exceptions import RayActorError

from configs.schema import RolloutConfig, RunConfig
from stages import seeds
from stages.filter_groups import generate_until_full
from stages.io.checkpoints import checkpoint_id, ref_checkpoint_id
from stages.models.engines import SamplingSpec
from stages.reward import score_rollouts
from stages.tools import resolve_tool_config
from stages.workers.group import WorkerGroup, engine_threads, existing_workers, worker_group
from stages.workers.placement import CPU_ONLY, GpuPool
from stages.workers.rollout_worker import RolloutWorker
from stages.workers.sharded import LocalGroup, local_group, sharded_call

log = logging.getLogger(__name__)


def sampling_from_config(
    rollout_cfg: RolloutConfig, max_tokens: int, *, seed: int, greedy: bool = False, n: int | None = None
) -> SamplingSpec:
    return SamplingSpec(
        temperature=rollout_cfg.temperature,
        top_p=rollout_cfg.top_p,
        top_k=rollout_cfg.top_k,
        max_tokens=max_tokens,
        n=n if n is not None else rollout_cfg.n,
        seed=seed,
        stop=tuple(rollout_cfg.stop),
        greedy=greedy,
    )


def resolved_multi_turn(rollout_cfg: RolloutConfig):
    """rollout.multi_turn with its tool_config_path made absolute here, on the driver (a Ray worker's current
    directory is not the driver's); None when multi-turn is off."""
    mt = rollout_cfg.multi_turn
    if not mt.enable:
        return None
    return mt.model_copy(update={"tool_config_path": str(resolve_tool_config(mt.tool_config_path))})


def rollout_group(rollout_cfg: RolloutConfig, gpus: GpuPool = CPU_ONLY) -> WorkerGroup:
    """The run's "rollout" group (rollout.num_workers RolloutWorkers), created on first use; on a GPU pool
    rank i shares GPU i with the trainer (stages.workers.placement)."""
    return worker_group(
        RolloutWorker,
        "rollout",
        rollout_cfg.num_workers,
        threads=engine_threads(rollout_cfg.num_workers),
        gpus=gpus,
        engine=rollout_cfg.name,
        micro_batch_size=rollout_cfg.micro_batch_size,
        gpu_memory_utilization=rollout_cfg.gpu_memory_utilization,
    )


def local_rollout_group(rollout_cfg: RolloutConfig) -> LocalGroup:
    """One RolloutWorker in this process (use_ray=False), closed after its call (stages.workers.sharded)."""
    return local_group(
        RolloutWorker,
        engine_threads(rollout_cfg.num_workers),
        engine=rollout_cfg.name,
        micro_batch_size=rollout_cfg.micro_batch_size,
        gpu_memory_utilization=rollout_cfg.gpu_memory_utilization,
    )


def published_weights(model_dir: str) -> list:
    """[ref] of checkpoint model_dir's weights in Ray's object store when the run's trainer rank 0 published them
    (rollout.weight_sync=object_store, stages.workers.actor_worker.ActorWorker.publish), else [] (no actor group
    alive in this run yet -- version 0, a resumed or re-materialized run -- or another version; or its rank 0 was
    lost with its node): the engines then load the committed checkpoint from storage."""
    want = ref_checkpoint_id(model_dir) or checkpoint_id(model_dir)
    actors = existing_workers("actor")
    if want is None or not actors:
        return []
    try:
        return ray.get(actors[0].published_weights.remote(want))
    except RayActorError as exc:  # the trainer's node is gone: its weights are committed in storage anyway
        log.warning("trainer rank 0 is lost (%s); the engines load checkpoint %s from storage", exc, want)
        return []


def generate_rollouts(
    prompt_batch: pd.DataFrame,
    *,
    model_dir: str,
    rollout_cfg: RolloutConfig,
    max_tokens: int,
    seed: int,
    greedy: bool = False,
    n: int | None = None,
    use_ray: bool = True,
    gpus: GpuPool = CPU_ONLY,
    ask_trainer: bool = True,
) -> pd.DataFrame:
    """Generate over prompt_batch (prompt_id, prompt_token_ids, ...); one row per (prompt, sample) with
    rollout_id = position in (prompt_id, sample_index) order.

    Contiguous shards go to the ranks of the "rollout" group (a killed worker: the group is rebuilt and the call
    retried once); use_ray=False: to one RolloutWorker in this process, closed afterwards (local_rollout_group).
    gpus: the run's GPU pool (GpuPool.of(cfg.trainer)); the default is a CPU run. ask_trainer=False: the engines
    load the committed checkpoint instead of asking the trainer's rank 0 for published weights (one_step_off: that
    rank is busy with the next update, and Ray runs an actor's calls one at a time, so asking would wait for the
    update and undo the overlap)."""
    spec = sampling_from_config(rollout_cfg, max_tokens, seed=seed, greedy=greedy, n=n)
    mt = resolved_multi_turn(rollout_cfg)
    object_store = use_ray and ask_trainer and rollout_cfg.weight_sync == "object_store"
    weights = published_weights(model_dir) if object_store else []
    out = sharded_call(
        lambda: rollout_group(rollout_cfg, gpus) if use_ray else local_rollout_group(rollout_cfg),
        RolloutWorker.generate,
        prompt_batch,
        lambda shard: (model_dir, shard, spec, mt, use_ray, weights),
    )
    out = out.sort_values(["prompt_id", "sample_index"]).reset_index(drop=True)
    out["rollout_id"] = range(len(out))
    return out


def add_greedy_baselines(
    sampled: pd.DataFrame, prompts: pd.DataFrame, generate_greedy: Callable[[pd.DataFrame], pd.DataFrame]
) -> pd.DataFrame:
    """`sampled` plus one greedy response per group it holds (ReMax), marked is_baseline with sample_index -1
    and rollout_ids after the sampled ones (unique in the iteration); sampled rows get is_baseline False.

    prompts: the prompt rows (one per group_id, as in the prompt batch); generate_greedy(prompts) -> one
    rollout per prompt row, carrying its group_id."""
    groups = prompts[prompts["group_id"].isin(set(sampled["group_id"]))].reset_index(drop=True)
    greedy = generate_greedy(groups)
    if len(greedy) != len(groups) or set(greedy["group_id"]) != set(groups["group_id"]):
        raise ValueError(
            f"the greedy baseline pass returned {len(greedy)} rollouts for {len(groups)} prompts; "
            "ReMax needs exactly one per prompt (generate with n=1)"
        )
    start = int(sampled["rollout_id"].max()) + 1
    greedy = greedy.assign(sample_index=-1, is_baseline=True, rollout_id=np.arange(start, start + len(greedy)))
    return pd.concat([sampled.assign(is_baseline=False), greedy], ignore_index=True)


def sample_rollouts(batch: pd.DataFrame, *, model_dir: str, cfg: RunConfig, iteration: int) -> pd.DataFrame:
    """The iteration's rollouts: one generation of the batch, or DAPO rounds until the batch is full; with
    adv_estimator='remax' plus one greedy baseline row per generated prompt (add_greedy_baselines).
    batch: a prompt_batches partition with group_id and policy_version set."""
    ask_trainer = cfg.trainer.policy_lag == 0  # one_step_off: the trainer's rank 0 is busy (generate_rollouts)

    def generate(prompts: pd.DataFrame, r: int) -> pd.DataFrame:
        return generate_rollouts(
            prompts,
            model_dir=model_dir,
            rollout_cfg=cfg.rollout,
            max_tokens=cfg.data.max_response_length,
            seed=seeds.rollout(cfg.rollout.seed, iteration, r),
            gpus=GpuPool.of(cfg.trainer),
            ask_trainer=ask_trainer,
        )

    fg = cfg.algorithm.filter_groups
    if not fg.enable:
        out = generate(batch, 0).assign(gen_round=0)
    else:
        out = generate_until_full(
            batch,
            generate,
            lambda out: score_rollouts(
                out, cfg.reward, use_ray=False, max_response_length=cfg.data.max_response_length
            ),
            metric=fg.metric,
            correct_score=cfg.reward.score,
            need_groups=cfg.data.train_batch_size,
        )
    if cfg.algorithm.adv_estimator != "remax":
        return out
    return add_greedy_baselines(
        out,
        batch,
        lambda prompts: generate_rollouts(
            prompts,
            model_dir=model_dir,
            rollout_cfg=cfg.rollout,
            max_tokens=cfg.data.max_response_length,
            seed=seeds.rollout(cfg.rollout.seed, iteration),
            greedy=True,
            n=1,
            gpus=GpuPool.of(cfg.trainer),
            ask_trainer=ask_trainer,
        ),
    )
