"""Megatron-Core policy-update backend (actor.strategy='megatron'): TP x PP x DP over
torch.distributed (NCCL on GPU, gloo on CPU with the patches in cpu_patches)."""
from __future__ import annotations

from stages.train.megatron.worker import train_loop_per_worker

__all__ = ["train_loop_per_worker"]
