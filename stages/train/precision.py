"""Mixed precision of the policy's forward passes (actor.mixed_precision.param_dtype).

Choice: torch.autocast over float32 parameters. With param_dtype 'bfloat16' every forward that scores
the policy (the update's, the old_logprobs stage's recomputation, the reference model's) runs under
`torch.autocast(device_type, dtype=torch.bfloat16)`: matmuls (linear layers, attention, the LM head)
compute in bf16 from bf16 copies of the float32 weights made per forward, while autocast keeps its
float32 ops (softmax, norms' reductions, the residual adds that meet a float32 operand) in float32. The
parameters, their gradients (autograd accumulates into the float32 leaves) and AdamW's state stay
float32: the float32 weights are the master weights, and the checkpoint is float32 as before. The logits
are upcast to float32 before the temperature, log_softmax and entropy (stages.train.batching.
response_logits), so PPO ratios and the loss are float32 arithmetic on bf16-computed logits.

The alternative is an option, actor.mixed_precision.master_weights='fp32_master' (param_dtype 'bfloat16'
only): bf16 parameters with a separate float32 master copy (what Megatron's `bf16=True` optimizer does). The
torch strategy holds every trainable parameter in bf16 and steps a MasterAdamW on float32 masters with
float32-accumulated gradients (stages/train/master.py); fsdp uses FSDP2's MixedPrecisionPolicy over float32
shards (stages/train/fsdp.py). Forwards still enter this autocast, which then finds bf16 weights (no cast)
and keeps its float32 ops. Checkpoints are written from the masters, so they stay float32. It saves the
per-forward weight cast, not memory on one rank (bf16 parameters beside float32 masters are 1.5x the float32
weights); on an avx512_bf16 CPU it was not faster than autocast (docs/benchmarks.md), so autocast stays the
default. Not with megatron (configs/sections/actor.py says why) or LoRA.

The old log-probs and the reference log-probs use the update's precision, so the PPO ratio at the first
mini-batch is 1 up to the rounding of bf16 matmuls over differently padded batches (docs/benchmarks.md
measures it).
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""actor.mixed_precision.param_dtype values and the torch dtype of the forward's matmuls."""


def autocast(param_dtype: str, device: torch.device | str) -> AbstractContextManager:
    """torch.autocast at `param_dtype` on `device`'s type (cpu or cuda); disabled for float32, so a
    float32 forward is the plain one, bit for bit."""
    if param_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"Unknown param_dtype '{param_dtype}'. Valid: {sorted(COMPUTE_DTYPES)}")
    device_type = torch.device(device).type
    return torch.autocast(device_type, dtype=COMPUTE_DTYPES[param_dtype], enabled=param_dtype != "float32")
