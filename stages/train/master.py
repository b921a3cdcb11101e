"""bf16 parameters with float32 master weights (actor.mixed_precision.master_weights='fp32_master'), torch strategy.

The policy's trainable parameters are held in bfloat16, so the forward and backward compute in bf16 from them
with no per-forward weight cast (autocast, still entered by stages.train.batching.response_logits, finds bf16
weights and keeps its float32 ops: softmax, the norms' reductions). Buffers (the rotary inv_freq) stay float32
(verl's buffer_dtype). The optimizer is `MasterAdamW`: torch's AdamW over float32 copies of those parameters
(the masters), in model.parameters() order, so its state_dict has the autocast path's layout and an
optimizer.pt loads into either path.

Gradients: a post-accumulate-grad hook on each bf16 parameter adds its gradient, cast to float32, into its
master's .grad and frees the bf16 one, so the micro-batches of a mini-batch accumulate in float32 (Megatron's
main_grad). DDP is not used: `finish_grads` averages the float32 master gradients over the data-parallel ranks
(one all-reduce per tensor, Megatron's grad_reduce_in_fp32) and clips their global norm, in float32. Then
`step` runs AdamW on the masters and copies each master, rounded to bf16 (round-to-nearest-even), into its
parameter.

Checkpoints stay float32: `float32_params` makes each parameter its master for the duration of a write (a
swap of .data, no copy), so save_policy and the published weights are the masters, the weights a float32 or
autocast run would hold. A resume loads the float32 checkpoint (the masters, exactly) and the optimizer state.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor


class MasterAdamW(torch.optim.AdamW):
    """AdamW over float32 masters of `model`'s trainable parameters, which it casts to bfloat16 (in place)."""

    def __init__(self, model: torch.nn.Module, **adamw_kwargs) -> None:
        self.model_params = [p for p in model.parameters() if p.requires_grad]
        masters = [p.detach().to(torch.float32, copy=True) for p in self.model_params]
        super().__init__(masters, **adamw_kwargs)
        self.masters = masters
        """(float32 tensors, each the shape of its parameter), model.parameters() order."""
        with torch.no_grad():
            for p in self.model_params:
                p.data = p.data.to(torch.bfloat16)
        self._hooks = [p.register_post_accumulate_grad_hook(_into(m)) for p, m in zip(self.model_params, masters)]

    def finish_grads(self, clip: float, world: int = 1) -> Tensor:
        """Average the master gradients over the `world` ranks of the default group (a collective; a master
        without a gradient on this rank contributes zeros), clip their global norm to `clip` (<= 0: measure
        only); returns the norm, a float32 scalar."""
        if world > 1:
            for m in self.masters:
                if m.grad is None:
                    m.grad = torch.zeros_like(m)
                dist.all_reduce(m.grad)
                m.grad.div_(world)
        grads = [m for m in self.masters if m.grad is not None]
        return torch.nn.utils.clip_grad_norm_(grads, clip if clip > 0 else float("inf"))

    @torch.no_grad()
    def step(self, closure=None):
        """AdamW on the masters, then each bf16 parameter = its master rounded to bf16."""
        loss = super().step(closure)
        for p, m in zip(self.model_params, self.masters, strict=True):
            p.copy_(m)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The masters' gradients and any bf16 gradient left on the parameters."""
        super().zero_grad(set_to_none)
        for p in self.model_params:
            p.grad = None


def _into(master: Tensor):
    """The post-accumulate-grad hook of one bf16 parameter: master.grad += float32(p.grad); p.grad freed."""

    def hook(p: Tensor) -> None:
        g = p.grad.to(torch.float32)
        if master.grad is None:
            master.grad = g
        else:
            master.grad.add_(g)
        p.grad = None

    return hook


@contextmanager
def float32_params(optimizer) -> Iterator[None]:
    """While inside, each parameter of a MasterAdamW's model is its float32 master (the same storage, no copy):
    a checkpoint written here is float32. Any other optimizer: nothing changes."""
    if not isinstance(optimizer, MasterAdamW):
        yield
        return
    held = [p.data for p in optimizer.model_params]
    for p, m in zip(optimizer.model_params, optimizer.masters, strict=True):
        p.data = m
    try:
        yield
    finally:
        for p, d in zip(optimizer.model_params, held, strict=True):
            p.data = d
