"""FSDP2 backend of the torch actor (actor.strategy='fsdp'): torch's `fully_shard` over the trainer ranks.

The update is stages.train.actor.ppo_update, unchanged: only the model is sharded (each rank keeps 1/world of
every parameter, its gradient and its AdamW state; FSDP all-gathers a layer's parameters for its forward and
backward and reduce-scatters its gradients, averaged over the ranks as DDP averages them). Micro-batches
before a mini-batch's last skip the reduce-scatter (`no_grad_sync`, DDP's `no_sync`), so the gradient is
reduced once per optimizer step. Numerically it is DDP: float32 parameters gathered whole, the same
forward, the same global-norm clipping (over the sharded gradients, a DTensor norm made whole) and
elementwise AdamW on the shards; mixed precision is the same autocast as DDP's (stages.train.precision),
not FSDP's own MixedPrecisionPolicy, so the two backends compute the same thing. The exception is
actor.mixed_precision.master_weights='fp32_master': FSDP's MixedPrecisionPolicy (param_dtype bf16, reduce_dtype
float32; `BF16_COMPUTE`) over the float32 shards, which are the master weights: the parameters a unit computes
with are bf16 (cast once per all-gather, not per matmul), gradients reach the shards in float32, AdamW and the
checkpoint stay float32. The torch backend's fp32_master (stages.train.master) keeps whole bf16 parameters
beside separate masters instead; the two agree up to rounding, not bit for bit.

Checkpoints are the torch backend's (stages.io.checkpoints): `gather_checkpoint` collects the full
parameters into a plain HF model on rank 0 (safetensors via save_policy) and the full optimizer state in
`optimizer.state_dict()` layout, keyed by HF parameter order; `shard_policy` loads either back onto the
shards. So an iteration may switch between torch, fsdp and megatron.

Shape: one mesh dimension over all ranks (FSDP, no HSDP); each decoder layer (the model's
`_no_split_modules` classes) is one FSDP unit, the root (embeddings, final norm, LM head) another.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM

from configs.schema import OptimConfig
from stages.train.optim import make_optimizer, restore_optimizer

FULL = StateDictOptions(full_state_dict=True)
"""Whole (unsharded) tensors in the state dicts, on every rank."""
FULL_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)
"""Whole tensors on the CPU of rank 0 only (the other ranks get an empty dict)."""


def ensure_process_group(device: torch.device) -> None:
    """A one-process group when none exists (a one-rank actor group has none; FSDP's mesh needs one)."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    # an in-process store: a TCPStore would listen on every interface for a group of one
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def layer_classes(model) -> tuple[type, ...]:
    """The decoder-layer classes of an HF model (its `_no_split_modules`), each instance one FSDP unit."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    found = tuple({type(m) for m in model.modules() if type(m).__name__ in names})
    if not found:
        raise ValueError(
            f"{type(model).__name__} declares no decoder-layer class in _no_split_modules ({sorted(names)}), "
            "so actor.strategy='fsdp' cannot pick its FSDP units; use actor.strategy='torch'."
        )
    return found


BF16_COMPUTE = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
"""actor.mixed_precision.master_weights='fp32_master' on FSDP (verl's fsdp_config.mixed_precision): the float32
shards are the masters; each unit's all-gather casts them to bf16 parameters for its forward and backward, and
the gradients are accumulated (over no-sync micro-batches) and reduce-scattered in float32 onto the shards."""


def shard_model(model: torch.nn.Module, *, bf16_compute: bool = False) -> torch.nn.Module:
    """fully_shard every decoder layer, then the root, over all ranks of the default group (in place);
    bf16_compute: with the BF16_COMPUTE policy."""
    device = next(model.parameters()).device
    ensure_process_group(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = BF16_COMPUTE if bf16_compute else MixedPrecisionPolicy()
    layers = layer_classes(model)
    for module in model.modules():
        if isinstance(module, layers):
            fully_shard(module, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def param_names(model: torch.nn.Module) -> list[str]:
    """Parameter names in model.parameters() order: the index of each in the torch backend's optimizer state."""
    return [n for n, _ in model.named_parameters()]


def load_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load the torch backend's optimizer state (int keys in HF parameter order, whole tensors) onto the shards."""
    names = param_names(model)
    by_name = {
        "state": {names[int(i)]: s for i, s in state["state"].items()},
        "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=FULL)


def shard_policy(model: torch.nn.Module, optim_cfg: OptimConfig, ckpt_dir: str | Path, *, bf16_compute: bool = False):
    """(sharded model, optimizer, scheduler) of an HF policy loaded whole on every rank, with the optimizer
    state stored beside ckpt_dir (none at version 0); bf16_compute: shard_model's. Collective: every rank
    calls it."""
    model = shard_model(model, bf16_compute=bf16_compute)
    opt, sched = make_optimizer(model, optim_cfg)
    restore_optimizer(opt, sched, ckpt_dir, load=lambda o, state: load_full_optimizer_state(model, o, state))
    return model, opt, sched


def gather_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple:
    """(plain HF model, optimizer state dict in the torch backend's layout) with whole tensors on rank 0,
    (None, None) on the others. Collective: every rank calls it."""
    names = param_names(model)
    weights = get_model_state_dict(model, options=FULL_ON_RANK0)
    opt_state = get_optimizer_state_dict(model, optimizer, options=FULL_ON_RANK0)
    if dist.get_rank() != 0:
        return None, None
    index = {n: i for i, n in enumerate(names)}
    opt_state = {
        "state": {index[n]: s for n, s in opt_state["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in opt_state["param_groups"]],
    }
    plain = AutoModelForCausalLM.from_config(model.config, dtype=next(iter(weights.values())).dtype)
    plain.load_state_dict(weights, strict=True)
    plain.tie_weights()
    return plain.eval(), opt_state


@contextmanager
def no_grad_sync(model: torch.nn.Module) -> Iterator[None]:
    """FSDP2's DDP.no_sync: backward passes inside keep the gradients unreduced until a later synced one."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
