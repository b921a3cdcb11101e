"""The rollouts stage: each prompt of the iteration's batch -> rollout.n sampled responses, with
prompt and response token ids, per-token logprobs and finish reason (plus DAPO rounds and ReMax's
greedy baselines, see `sample_rollouts`).

Flow: assets/rollouts.py `materialize` -> `sample_rollouts(batch, cfg=...)` -> `generate_rollouts`, which
splits the batch into contiguous shards over the run's "rollout" worker group and calls
`RolloutWorker.generate` (stages/workers/rollout_worker.py) on each rank. The workers keep their engine
for the whole run and take each new policy version's weights in place.
"""

from __future__ import annotations

import logging

import pandas as pd
import ray
from ray.exceptions import RayActorError

from configs.schema import RolloutConfig, RunConfig
from stages import seeds
from stages.filter_groups import generate_until_full
from stages.io import dataset_io
from stages.io.checkpoints import checkpoint_id, ref_checkpoint_id
from stages.io.tables import SCHEMAS
from stages.models.engines import SamplingSpec
from stages.rollout_shards import TOKEN_COLUMNS, NumberRollouts, in_batch_order, rollout_order
from stages.scored_rollouts import score_rollouts
from stages.tools import resolve_tool_config
from stages.workers.group import WorkerGroup, engine_threads, existing_workers, worker_group
from stages.workers.placement import CPU_ONLY, GpuPool
from stages.workers.rollout_worker import RolloutWorker
from stages.workers.shard_io import ShardResult, Sink
from stages.workers.sharded import LocalGroup, local_group, shard_frames, sharded_run

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


def generate_shards(
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
    first_id: int = 0,
    stamp: dict | None = None,
    sink: Sink | None = None,
) -> list[ShardResult]:
    """One generation pass over prompt_batch (prompt_id, prompt_token_ids, ...) on the "rollout" group: n rows
    per prompt row with rollout_id = first_id + the place in (prompt_id, sample_index) order
    (stages/rollout_shards.py), `stamp`'s columns set. Each rank numbers its rows and, with a `sink`, writes them
    as one file (commit the files with commit_shards); else sends them back. One ShardResult per called rank, in
    rank order (= rollout_id order); each carries its rows' summary (rollout_shards.rollout_summary).

    Contiguous runs of that order go to the ranks (a killed worker: the group is rebuilt and the call retried
    once); use_ray=False: to one RolloutWorker in this process, closed afterwards (local_rollout_group).
    gpus: the run's GPU pool (GpuPool.of(cfg.trainer)); the default is a CPU run. ask_trainer=False: the engines
    load the committed checkpoint instead of asking the trainer's rank 0 for published weights (one_step_off: that
    rank is busy with the next update, and Ray runs an actor's calls one at a time, so asking would wait for the
    update and undo the overlap)."""
    spec = sampling_from_config(rollout_cfg, max_tokens, seed=seed, greedy=greedy, n=n)
    mt = resolved_multi_turn(rollout_cfg)
    object_store = use_ray and ask_trainer and rollout_cfg.weight_sync == "object_store"
    weights = published_weights(model_dir) if object_store else []
    return sharded_run(
        lambda: rollout_group(rollout_cfg, gpus) if use_ray else local_rollout_group(rollout_cfg),
        RolloutWorker.generate,
        rollout_order(prompt_batch, spec.n, first_id),
        lambda shard: (model_dir, shard, spec, mt, use_ray, weights),
        sink=sink,
        prepare=in_batch_order,
        finish=NumberRollouts(spec.n, dict(stamp or {})),
    )


def generate_rollouts(prompt_batch: pd.DataFrame, **kwargs) -> pd.DataFrame:
    """generate_shards' rows, back in this process (validation, tests): one row per (prompt, sample) with
    rollout_id = position in (prompt_id, sample_index) order."""
    return shard_frames(generate_shards(prompt_batch, **kwargs))


def written_rows(results: list[ShardResult], sink: Sink | None, columns: list[str] | None = None) -> pd.DataFrame:
    """The rows of a pass: sent back (no sink), or read from the files the ranks wrote (`columns` of them)."""
    if sink is None:
        return shard_frames(results)
    files = [r.files for r in results if r.files is not None and len(r.files)]
    return dataset_io.read_file_records(sink.uri, pd.concat(files, ignore_index=True), columns)


def sample_rollouts(
    batch: pd.DataFrame, *, model_dir: str, cfg: RunConfig, iteration: int, sink: Sink | None = None
) -> list[ShardResult]:
    """The iteration's rollouts: one generation of the batch, or DAPO rounds until the batch is full; with
    adv_estimator='remax' plus one greedy baseline row per generated prompt, is_baseline, sample_index -1,
    rollout_ids after the sampled ones. batch: a prompt_batches partition with group_id and policy_version set.
    With a `sink` the ranks write every pass's rows (commit them with commit_shards); else shard_frames(result)
    is the partition. The ranks' results of every pass, in rollout_id order."""
    ask_trainer = cfg.trainer.policy_lag == 0  # one_step_off: the trainer's rank 0 is busy (generate_shards)
    common = {
        "model_dir": model_dir,
        "rollout_cfg": cfg.rollout,
        "max_tokens": cfg.data.max_response_length,
        "gpus": GpuPool.of(cfg.trainer),
        "ask_trainer": ask_trainer,
        "sink": sink,
    }
    remax = cfg.algorithm.adv_estimator == "remax"

    def generate(prompts: pd.DataFrame, r: int, first_id: int) -> list[ShardResult]:
        stamp = {"gen_round": r, **({"is_baseline": False} if remax else {})}
        seed = seeds.rollout(cfg.rollout.seed, iteration, r)
        return generate_shards(prompts, seed=seed, first_id=first_id, stamp=stamp, **common)

    passes, generated = sampled_passes(batch, generate, cfg, sink)
    results = [r for p in passes for r in p]
    if not remax:
        return results
    greedy = generate_shards(  # one greedy response per generated prompt, numbered after the samples
        generated.reset_index(drop=True),
        seed=seeds.rollout(cfg.rollout.seed, iteration),
        greedy=True,
        n=1,
        first_id=sum(r.rows for r in results),
        stamp={"is_baseline": True, "sample_index": -1},
        **common,
    )
    return results + greedy


def sampled_passes(
    batch: pd.DataFrame, generate, cfg: RunConfig, sink: Sink | None
) -> tuple[list[list[ShardResult]], pd.DataFrame]:
    """(each generation pass's results, the prompts they generated for): the whole batch once, or DAPO's rounds
    until enough groups pass the filter (each round scored from its rows: read back from the ranks' files without
    the token columns when they wrote them). generate(prompts, round, first rollout_id) -> a pass's results."""
    fg = cfg.algorithm.filter_groups
    if not fg.enable:
        return [generate(batch, 0, 0)], batch
    passes = generate_until_full(
        batch,
        generate,
        lambda results: score_rollouts(
            written_rows(results, sink, columns=scoring_columns()),
            cfg.reward,
            use_ray=False,
            max_response_length=cfg.data.max_response_length,
        ),
        metric=fg.metric,
        correct_score=cfg.reward.score,
        need_groups=cfg.data.train_batch_size,
    )
    rounds = sorted(int(r) for r in batch["gen_round"].unique())[: len(passes)]
    return passes, batch[batch["gen_round"].isin(rounds)]


def scoring_columns() -> list[str]:
    """The rollouts columns a rule or custom reward reads: all but the per-token ones."""
    return [c for c in SCHEMAS["rollouts"].names if c not in TOKEN_COLUMNS]
