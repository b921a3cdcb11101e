"""Optimizer of every trainer (torch actor, Megatron actor, critic): AdamW with linear LR warm-up,
global-norm gradient clipping, one checked optimizer step, and the one loader of the optimizer state
stored beside a checkpoint (stages.io.checkpoints.OPTIMIZER_FILE, HF parameter order).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from configs.schema import OptimConfig
from stages.io.checkpoints import load_optimizer_state, save_optimizer_state
from stages.train.master import MasterAdamW

__all__ = [
    "ACTOR_GRAD_ERROR",
    "CRITIC_GRAD_ERROR",
    "clip_grads",
    "load_optimizer_state",
    "make_optimizer",
    "optimizer_step",
    "restore_optimizer",
    "save_optimizer_state",
]

ACTOR_GRAD_ERROR = "non-finite grad norm {norm} at update; lower actor.optim.lr or check the advantages table"
CRITIC_GRAD_ERROR = (
    "non-finite critic grad norm {norm}; lower critic.optim.lr or check the returns in the advantages table"
)


def make_optimizer(
    model, optim_cfg: OptimConfig, master_weights: str = "autocast"
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the parameters that require grad (all of them, or a LoRA policy's adapters alone) and a
    LambdaLR scheduler ramping linearly over lr_warmup_steps steps. master_weights
    (actor.mixed_precision.master_weights) 'fp32_master': a MasterAdamW over float32 masters of those
    parameters, which it casts to bfloat16 in place (stages.train.master)."""
    kwargs = {"lr": optim_cfg.lr, "betas": tuple(optim_cfg.betas), "weight_decay": optim_cfg.weight_decay}
    if master_weights == "fp32_master":
        opt = MasterAdamW(model, **kwargs)
    elif master_weights == "autocast":
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **kwargs)
    else:
        raise ValueError(f"Unknown master_weights '{master_weights}'. Valid: ['autocast', 'fp32_master']")
    warm = optim_cfg.lr_warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if warm > 0 else 1.0)
    return opt, sched


def restore_optimizer(
    optimizer: torch.optim.Optimizer,
    scheduler,
    ckpt_dir: str | Path,
    *,
    load: Callable[[torch.optim.Optimizer, dict], None] | None = None,
) -> bool:
    """Load the optimizer and scheduler state stored beside the checkpoint at ckpt_dir; False (nothing
    loaded, a fresh optimizer) when it has none, as version 0.

    load(optimizer, stored_state_dict) replaces `optimizer.load_state_dict` for an optimizer whose
    parameters are not the checkpoint's HF parameters (Megatron converts the state to its shard)."""
    state = load_optimizer_state(ckpt_dir)
    if state is None:
        return False
    if load is None:
        optimizer.load_state_dict(state["optimizer"])
    else:
        load(optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return True


def clip_grads(model, clip: float, optimizer=None, world: int = 1) -> Tensor:
    """Global-norm gradient clipping over the parameters that got a gradient (clip <= 0: measure only).
    FSDP's sharded gradients (DTensors) give a DTensor norm over all shards; it is returned as a plain tensor.
    A MasterAdamW `optimizer`: its float32 master gradients instead, first averaged over `world` ranks."""
    if isinstance(optimizer, MasterAdamW):
        return optimizer.finish_grads(clip, world)
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def optimizer_step(optimizer, scheduler, grad_norm: Tensor, add, *, prefix: str, error: str) -> None:
    """One optimizer + LR-scheduler step after the gradients of a mini-batch are final: refuses a
    non-finite grad norm (`error` is the message, with {norm}), logs <prefix>/grad_norm and <prefix>/lr."""
    if not torch.isfinite(grad_norm):
        raise FloatingPointError(error.format(norm=float(grad_norm)))
    add(f"{prefix}/grad_norm", float(grad_norm))
    add(f"{prefix}/lr", optimizer.param_groups[0]["lr"])
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
