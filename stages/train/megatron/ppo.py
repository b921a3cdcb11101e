"""PPO policy optimization of one Megatron-Core GPTModel stage: the Megatron twin of
`stages.train.actor.ppo_update`, with the same batch layout, loss, schedule of optimizer steps and
metric keys.

Choices:
- Micro-batches run through megatron's pipeline schedule (`get_forward_backward_func()`:
  no pipelining for PP = 1, 1F1B otherwise). The loss of a micro-batch is already its share of the
  mini-batch's loss (`actor_loss` over the mini-batch's `GlobalBatch`, counted over the DP group, as
  the torch backend), so it is multiplied by the number of micro-batches to undo the schedule's
  division by it (verl does the same).
- Logits are gathered over TP (`parallel_output=False`), so the schedule's loss is the torch backend's
  `stages.train.ppo_loop.actor_loss`, unchanged, on every TP rank of the last stage; the epochs,
  mini-batches and optimizer steps are the same `ppo_loop`.
- Old log-probs are recomputed with the same schedule (forward only) before the first step.
- Gradients: tied-embedding grads summed over the embedding group (PP > 1), averaged over the
  DP group (DDP semantics), clipped by the global norm over the model-parallel group, counting
  TP-replicated parameters and the last stage's embedding copy once. Then plain torch AdamW on
  the local shards (elementwise, so equal to AdamW on the full tensors).
- Attention: causal plus key-padding mask; RoPE uses positions 0..T-1 rather than HF's
  position_ids, which changes no score because a row's real tokens are contiguous (left-padded
  prompt, right-padded response) and RoPE scores depend on position differences only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from configs.schema import ActorConfig
from stages.algos.losses import gather_logprobs
from stages.train.batching import actor_batch, model_device, select_rows, tempered, to_device
from stages.train.megatron.convert import tp_partition_dim
from stages.train.optim import ACTOR_GRAD_ERROR
from stages.train.ppo_loop import (
    MetricAccumulator,
    actor_loss,
    apply_rollout_correction,
    fold_minibatch,
    mean_over_workers,
    mini_batch_counts,
    ppo_loop,
)


def megatron_attention_mask(attention_mask: Tensor) -> Tensor:
    """(N, T) {0,1} -> (N, 1, T, T) bool, True = masked: causal and padded keys."""
    t = attention_mask.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()  # (T, T)
    allowed = causal[None] & attention_mask.bool()[:, None, :]  # (N, T, T)
    return ~allowed[:, None]  # (N, 1, T, T)


def run_schedule(
    model,
    batch: dict,
    micro_idx: list[Tensor],
    loss_fn,
    *,
    vocab_size: int,
    forward_only: bool,
    temperature: float = 1.0,
) -> list:
    """Run micro-batches (row indices into batch) through megatron's schedule.

    loss_fn(mb, logits (n_mb, L, V)) -> (scalar loss, metrics) is called on the last stage only;
    returns the metrics of every micro-batch there (an empty list on other stages).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: PLC0415 - megatron-core is an optional extra

    mbs = [select_rows(batch, idx) for idx in micro_idx]
    p_len, l_len = batch["prompt_len"], batch["responses"].shape[1]

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        output = model(mb["input_ids"], mb["position_ids"], mb["mask4d"])
        # last stage: (n_mb, T, V_padded) logits; earlier stages: hidden states
        # (n_mb, L, V) response logits at the rollout temperature, as stages.train.batching.response_logits
        return output, lambda out: loss_fn(
            mb, tempered(out[:, p_len - 1 : p_len - 1 + l_len, :vocab_size], temperature)
        )

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(mbs),
        model=[model],
        num_microbatches=len(mbs),
        seq_length=batch["input_ids"].shape[1],
        micro_batch_size=len(micro_idx[0]),
        forward_only=forward_only,
    )


@torch.no_grad()
def compute_old_logprobs(model, batch: dict, mb_size: int, vocab_size: int, temperature: float = 1.0) -> Tensor:
    """(N, L) log-probs of the responses on the last stage; zeros elsewhere."""
    from megatron.core import parallel_state as ps  # noqa: PLC0415 - megatron-core is an optional extra

    n = batch["input_ids"].shape[0]
    idx = list(torch.arange(n).split(mb_size))
    outs = run_schedule(
        model,
        batch,
        idx,
        lambda mb, logits: (logits.new_zeros(()), {"logprobs": gather_logprobs(logits, mb["responses"])}),
        vocab_size=vocab_size,
        forward_only=True,
        temperature=temperature,
    )
    if not ps.is_pipeline_last_stage():
        return torch.zeros_like(batch["response_mask"])
    return torch.cat([o["logprobs"] for o in outs])


def finish_grads(model, named_params: list[tuple[str, Tensor]], *, tied: bool, clip: float) -> Tensor:
    """Embedding-group sum, DP average, global-norm clipping of the local grads; returns the norm."""
    from megatron.core import parallel_state as ps  # noqa: PLC0415 - megatron-core is an optional extra

    if tied and ps.get_pipeline_model_parallel_world_size() > 1 and ps.is_rank_in_embedding_group():
        dist.all_reduce(model.shared_embedding_or_output_weight().grad, group=ps.get_embedding_group())
    named_params = [(name, p) for name, p in named_params if p.grad is not None]
    grads = [p.grad for _, p in named_params]
    dp = ps.get_data_parallel_world_size()
    if dp > 1:
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=ps.get_data_parallel_group())
        flat /= dp
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            g.copy_(synced)
    tp_rank = ps.get_tensor_model_parallel_rank()
    counted = [
        p.grad
        for name, p in named_params
        if not (tp_partition_dim(name) is None and tp_rank > 0) and not (tied and name == "output_layer.weight")
    ]
    zero = torch.zeros((), device=model_device(model))  # on the group's device: NCCL reduces CUDA tensors only
    sq = torch.stack([g.float().pow(2).sum() for g in counted]).sum() if counted else zero
    dist.all_reduce(sq, group=ps.get_model_parallel_group())
    norm = sq.sqrt()
    coef = (clip if clip > 0 else float("inf")) / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_
    for g in grads:
        g.mul_(coef.clamp(max=1.0))
    return norm


def _prepare_batch(
    rows: dict,
    actor_cfg: ActorConfig,
    pad_id: int,
    device: torch.device | str = "cpu",
    *,
    rollout_logprobs: bool = False,
) -> dict:
    """The torch backend's batch (stages.train.batching.actor_batch, with the engine's rollout_logprobs when
    rollout_logprobs) plus megatron's 4-D attention mask, every tensor on `device` (the model stage's)."""
    batch = actor_batch(rows, pad_id, use_kl_loss=actor_cfg.use_kl_loss, rollout_logprobs=rollout_logprobs)
    batch["mask4d"] = megatron_attention_mask(batch["attention_mask"])  # (N, 1, T, T)
    return to_device(batch, device)


def _reduce_metrics(acc: MetricAccumulator, dp: int) -> dict[str, float]:
    """Means over optimizer steps; loss metrics come from the last stage; averaged over DP."""
    from megatron.core import parallel_state as ps  # noqa: PLC0415 - megatron-core is an optional extra

    metrics = acc.means()
    if ps.get_pipeline_model_parallel_world_size() > 1:
        box = [metrics]
        dist.broadcast_object_list(
            box, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
        )
        metrics = {**box[0], **{k: metrics[k] for k in ("actor/grad_norm", "actor/lr") if k in metrics}}
    metrics = mean_over_workers(metrics, dp, group=ps.get_data_parallel_group())
    return dict(sorted(metrics.items()))


# long: the docstring, the pipeline's divisibility error and the shared loop's arguments, one per line
def megatron_ppo_update(
    model,
    optimizer,
    scheduler,
    rows: dict,
    actor_cfg: ActorConfig,
    *,
    vocab_size: int,
    tied: bool,
    n_per_prompt: int,
    pad_id: int,
    micro_batch_size: int,
    seed: int = 0,
    temperature: float = 1.0,
    rollout_correction=None,
) -> dict[str, float]:
    """One iteration's policy optimization of this rank's stage on its DP share of the batch.

    Args: as `stages.train.actor.ppo_update`; rows are this DP rank's rollouts (the same on every
    TP/PP rank of a replica); micro_batch_size rollouts per pipeline micro-batch.
    Returns: the torch backend's metric keys, equal on every rank.
    """
    from megatron.core import parallel_state as ps  # noqa: PLC0415 - megatron-core is an optional extra

    dp = ps.get_data_parallel_world_size()
    on = rollout_correction is not None and rollout_correction.enabled
    batch = _prepare_batch(rows, actor_cfg, pad_id, model_device(model), rollout_logprobs=on)
    n = batch["input_ids"].shape[0]
    model.eval()
    batch["old_logprobs"] = compute_old_logprobs(model, batch, micro_batch_size, vocab_size, temperature)
    model.train()
    per_worker_mini = actor_cfg.ppo_mini_batch_size * n_per_prompt // dp
    if n % per_worker_mini or per_worker_mini % micro_batch_size:
        raise ValueError(
            f"{n} rollouts per DP rank must split into mini-batches of {per_worker_mini} and those "
            f"into micro-batches of {micro_batch_size} (the pipeline needs equal micro-batches); "
            "set actor.megatron.micro_batch_size to a divisor. A batch that lost rollouts (reward.on_error='flag' "
            "drops the flagged ones) cannot split so: use actor.strategy='torch' or 'fsdp' with on_error='flag'."
        )
    metrics = MetricAccumulator()  # rollout correction: on the last stage's old log-probs (its metrics are kept)
    metrics.add_all(apply_rollout_correction(batch, rollout_correction, dp_size=dp, group=ps.get_data_parallel_group()))

    def backward(micro: list[Tensor]) -> None:
        global_batch = mini_batch_counts(batch["response_mask"][torch.cat(micro)], dp, ps.get_data_parallel_group())
        micro_metrics = []

        def loss_fn(mb: dict, logits: Tensor) -> tuple[Tensor, dict[str, float]]:
            loss, m = actor_loss(logits, mb, actor_cfg, global_batch)  # called on the last pipeline stage only
            micro_metrics.append(m)
            return loss * len(micro), m

        run_schedule(model, batch, micro, loss_fn, vocab_size=vocab_size, forward_only=False, temperature=temperature)
        fold_minibatch(metrics, micro_metrics)

    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    ppo_loop(
        n,
        mini_batch_size=per_worker_mini,
        micro_batch_size=micro_batch_size,
        epochs=actor_cfg.ppo_epochs,
        seed=seed,
        backward=backward,
        finish_grads=lambda: finish_grads(model, named, tied=tied, clip=actor_cfg.optim.grad_clip),
        optimizer=optimizer,
        scheduler=scheduler,
        metrics=metrics,
        prefix="actor",
        error=ACTOR_GRAD_ERROR,
    )
    model.eval()
    out = _reduce_metrics(metrics, dp)
    out["actor/num_rollouts"] = float(n * dp)
    return out
