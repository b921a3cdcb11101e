"""Torch policy-optimization backend: PPO-clip epochs over mini-batches with micro-batch
gradient accumulation (stages.train.ppo_loop), data parallel over a torch.distributed (gloo, or NCCL
on GPUs) group when one exists. Every batch tensor is moved to the model's device (a trainer rank's
cuda:0 on a GPU run, stages.workers.placement), so the same code trains on the CPU or a GPU.

Runs without Ray (unit tests call `ppo_update` directly); the policy update runs it on every rank of the
run's persistent gloo worker group. The PPO ratio's old log-probs are the old_logprobs stage's (verl's
`compute_log_prob`: the same resident policy, before the update, stages/old_logprobs.py), carried in the
rows; rows without them (unit tests, tables from before that stage) get them recomputed here, before the
first optimizer step. Either way the ratio is 1 at the first micro-batch up to float rounding of the
padding (exactly 1 when recomputed here).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from configs.schema import ActorConfig
from stages.algos.losses import GlobalBatch, gather_logprobs
from stages.train.batching import actor_batch, model_device, response_logits, select_rows, to_device
from stages.train.optim import ACTOR_GRAD_ERROR, clip_grads
from stages.train.packing import packed_response_terms, split_by_tokens, token_budget_micro_batches
from stages.train.ppo_loop import (
    MetricAccumulator,
    accumulate_grads,
    actor_loss,
    actor_loss_terms,
    apply_rollout_correction,
    collective_device,
    global_minibatch_count,
    mean_over_workers,
    ppo_loop,
)


def _world_size() -> int:
    """Ranks of the torch.distributed group this process is in (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@torch.no_grad()
def compute_logprobs(
    model,
    batch: dict,
    micro_batch_size: int,
    temperature: float = 1.0,
    *,
    param_dtype: str = "float32",
    max_token_len: int | None = None,
) -> Tensor:
    """Float32 log-probs of the response tokens under `model` at `temperature`, its forward computed at
    param_dtype (stages.train.precision): (N, L). max_token_len (actor.log_prob_max_token_len_per_gpu with
    actor.use_dynamic_bsz): packed micro-batches of at most that many real tokens (stages.train.packing) instead
    of micro_batch_size padded rows, 0 on the padding (where the padded path has the pad positions' values)."""
    n, device = batch["input_ids"].shape[0], model_device(model)
    if max_token_len is not None:
        parts = split_by_tokens(torch.arange(n), batch["attention_mask"].sum(-1).cpu(), max_token_len)
        done = [
            packed_response_terms(
                model, to_device(select_rows(batch, idx), device), temperature, param_dtype, entropy=False
            )[0]
            for idx in parts
        ]  # (n_mb, L) each
        order = torch.argsort(torch.cat(parts)).to(device)
        return torch.cat(done)[order]  # (N, L) in the batch's row order
    chunks = []
    for s in range(0, n, micro_batch_size):
        mb = to_device(select_rows(batch, torch.arange(s, min(s + micro_batch_size, n))), device)
        logits = response_logits(model, mb, temperature, param_dtype=param_dtype)  # (n_mb, L, V)
        chunks.append(gather_logprobs(logits, mb["responses"]))
    return torch.cat(chunks)


def dynamic_split(token_lengths: Tensor, max_token_len: int, world: int) -> Callable[[Tensor], list[Tensor]]:
    """ppo_loop's `split` for actor.use_dynamic_bsz: a mini-batch's rows cut by the token budget
    (stages.train.packing.split_by_tokens), with as many micro-batches on every data-parallel rank (the most any
    rank needs: FSDP's forwards are collectives); token_lengths (N,) the rows' real tokens."""

    def split(mini: Tensor) -> list[Tensor]:
        count = len(token_budget_micro_batches(token_lengths[mini].tolist(), max_token_len))
        if world > 1:
            t = torch.tensor([count], dtype=torch.int64, device=collective_device())
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            count = int(t.item())
        return split_by_tokens(mini, token_lengths, max_token_len, min_count=count)

    return split


# long: the docstring and the shared loop's arguments, one per line; the logic is the 20 lines between
def ppo_update(
    model,
    optimizer,
    scheduler,
    rows: dict,
    actor_cfg: ActorConfig,
    *,
    n_per_prompt: int,
    pad_id: int,
    seed: int = 0,
    ddp_model=None,
    no_sync=None,
    temperature: float = 1.0,
    rollout_correction=None,
) -> dict[str, float]:
    """One iteration's policy optimization on this worker's share of the batch.

    Args:
        rows: prompt_token_ids (list of N lists), response_token_ids (N lists), advantages (N,)
            float tensor, optional ref_logprobs and old_logprobs (N lists each), optional response_mask (N 0/1
            lists or None, stages.train.batching.row_masks: observation tokens (0) stay in the context but get no
            loss, KL or entropy and do not count in loss_agg_mode's normalisation). N is this worker's rollouts;
            they are split into ppo_epochs x (mini-batches of ppo_mini_batch_size * n / world) rollouts.
        optimizer: torch AdamW over model's parameters, or a MasterAdamW over their float32 masters
            (actor.mixed_precision.master_weights='fp32_master', stages.train.master), which averages its
            gradients over the ranks itself (then ddp_model must be None).
        ddp_model: the DistributedDataParallel wrapper when world > 1 (model is its .module); None for a
            model that syncs its own gradients (FSDP's fully_shard, stages.train.fsdp) or a MasterAdamW.
        no_sync: a context manager deferring the gradient reduction to the mini-batch's last micro-batch;
            default DDP's ddp_model.no_sync (FSDP: stages.train.fsdp.no_grad_sync(model)).
        temperature: logits are divided by it for old/new log-probs and the entropy (verl: the
            rollout's sampling temperature, so the PPO ratio compares the distributions that sampled).
        rollout_correction: algorithm.rollout_correction (configs.schema.RolloutCorrectionConfig) or None; when
            on, rows must carry the engine's rollout_logprobs (N lists), and the policy loss is corrected
            (stages.train.ppo_loop.apply_rollout_correction; its rollout_corr/ metrics are returned too).
    Returns:
        metrics averaged over optimizer steps and workers (loss terms: the mini-batch's loss): actor/pg_loss, ...
    """
    world = _world_size()
    train_model = ddp_model or model
    on = rollout_correction is not None and rollout_correction.enabled
    batch = actor_batch(rows, pad_id, use_kl_loss=actor_cfg.use_kl_loss, rollout_logprobs=on)
    batch = to_device(batch, model_device(model))
    n = batch["input_ids"].shape[0]
    mb_size = actor_cfg.ppo_micro_batch_size
    param_dtype = actor_cfg.mixed_precision.param_dtype
    budget = actor_cfg.log_prob_max_token_len_per_gpu if actor_cfg.use_dynamic_bsz else None
    if "old_logprobs" not in batch:  # rows without the old_logprobs stage's (unit tests): recompute them
        model.eval()
        batch["old_logprobs"] = compute_logprobs(
            model, batch, mb_size, temperature, param_dtype=param_dtype, max_token_len=budget
        )
    model.train()
    per_worker_mini = actor_cfg.ppo_mini_batch_size * n_per_prompt // world
    # a batch short of a multiple of the mini-batch (flagged rollouts dropped) keeps its number of steps
    total, steps = global_minibatch_count(n, per_worker_mini, world)
    metrics = MetricAccumulator()
    metrics.add_all(apply_rollout_correction(batch, rollout_correction, dp_size=world))

    def loss_fn(mb: dict, global_batch: GlobalBatch) -> tuple[Tensor, dict[str, float]]:
        if actor_cfg.use_dynamic_bsz:  # one packed row, log-probs and entropy (n_mb, L): 0 on padding
            logprobs, entropy = packed_response_terms(train_model, mb, temperature, param_dtype)
            return actor_loss_terms(logprobs, entropy, mb, actor_cfg, global_batch)
        logits = response_logits(train_model, mb, temperature, param_dtype=param_dtype)  # (n_mb, L, V)
        return actor_loss(logits, mb, actor_cfg, global_batch)

    split = None
    if actor_cfg.use_dynamic_bsz:
        split = dynamic_split(batch["attention_mask"].sum(-1).cpu(), actor_cfg.ppo_max_token_len_per_gpu, world)
    if no_sync is None and ddp_model is not None:
        no_sync = ddp_model.no_sync
    ppo_loop(
        n,
        mini_batch_size=per_worker_mini,
        micro_batch_size=mb_size,
        epochs=actor_cfg.ppo_epochs,
        seed=seed,
        backward=lambda micro: accumulate_grads(batch, micro, loss_fn, metrics, dp_size=world, no_sync=no_sync),
        finish_grads=lambda: clip_grads(model, actor_cfg.optim.grad_clip, optimizer, world),
        optimizer=optimizer,
        scheduler=scheduler,
        metrics=metrics,
        prefix="actor",
        error=ACTOR_GRAD_ERROR,
        steps=steps,
        split=split,
    )
    model.eval()
    out = mean_over_workers(metrics.means(), world)
    out["actor/num_rollouts"] = float(total)
    return out
