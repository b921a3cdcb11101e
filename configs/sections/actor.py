"""The `actor` section: the policy trainer (backend, PPO batch sizes and clipping, optimizer, precision,
LoRA)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from configs.sections.base import _Strict


class OptimConfig(_Strict):
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    lr_warmup_steps: int = 0
    """Linear warm-up over this many optimizer steps."""
    grad_clip: float = 1.0
    """Max global grad norm; <= 0 disables clipping."""


class MegatronConfig(_Strict):
    """Megatron-Core backend layout (used when actor.strategy='megatron')."""

    tensor_model_parallel_size: int = 1
    """TP ranks per model replica (must divide attention heads, KV heads and intermediate_size)."""
    pipeline_model_parallel_size: int = 1
    """PP stages per model replica (must divide num_hidden_layers); DP = num_workers / (TP * PP)."""
    micro_batch_size: int | None = None
    """Rollouts per pipeline micro-batch; None uses actor.ppo_micro_batch_size."""


class PolicyLossConfig(_Strict):
    loss_mode: Literal["vanilla", "gspo"] = "vanilla"
    """vanilla: token-level PPO clip (+ clip-higher, dual clip); gspo: sequence-level ratio (GSPO)."""


class MixedPrecisionConfig(_Strict):
    """Compute precision of the policy's forward passes (verl: actor_rollout_ref.actor.fsdp_config.mixed_precision,
    here for every actor backend; stages/train/precision.py)."""

    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype the forward's matmuls compute in (verl's param_dtype, whose default is bf16): 'bfloat16' runs the
    update's, the old log-probs' and the reference model's forwards under torch.autocast over float32
    parameters, so weights, gradients, AdamW state and checkpoints stay float32 and the logits are upcast to
    float32 before log_softmax. Pays only where the hardware has bf16 matmul units (CUDA; CPUs with
    avx512_bf16/AMX): docs/benchmarks.md."""
    master_weights: Literal["autocast", "fp32_master"] = "autocast"
    """With param_dtype 'bfloat16', where the float32 weights live. 'autocast': the parameters are float32 (the
    master weights) and each forward casts them to bf16. 'fp32_master' (Megatron's bf16=True; verl's FSDP
    param_dtype=bf16): the actor's parameters are held in bf16 (no per-forward cast, half the weight memory)
    and AdamW steps on a float32 master copy with float32 gradients, then refreshes the bf16 parameters from
    it; checkpoints are written from the masters (float32). torch and fsdp strategies (stages/train/master.py,
    stages/train/fsdp.py); the reference model keeps autocast."""

    @model_validator(mode="after")
    def _fp32_master_needs_bf16(self) -> MixedPrecisionConfig:
        if self.master_weights == "fp32_master" and self.param_dtype != "bfloat16":
            raise ValueError(
                f"actor.mixed_precision.master_weights='fp32_master' needs param_dtype='bfloat16' (got "
                f"'{self.param_dtype}'), because it keeps bf16 parameters beside float32 masters, and float32 "
                "parameters are their own masters; set actor.mixed_precision.param_dtype=bfloat16, or "
                "master_weights='autocast' for a float32 update."
            )
        return self


class LoraConfig(_Strict):
    """LoRA adapters on the actor (peft; stages/models/lora.py). verl: actor_rollout_ref.model.lora_rank,
    lora_alpha, target_modules."""

    rank: int = Field(0, ge=0)
    """Adapter rank r; 0 = off (full fine-tuning). With r > 0 only the adapters train and sit in the optimizer;
    checkpoints hold the merged weights (what engines and `rlake export` read) plus the adapter and its base."""
    alpha: float = 16.0
    """Scale numerator: the update is B @ A * alpha / rank (verl's lora_alpha default 16)."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input during the update (peft lora_dropout); 0 keeps the PPO ratio exactly 1
    at the first micro-batch."""
    target_modules: str | list[str] = "all-linear"
    """Module names to adapt (peft target_modules): 'all-linear' (every linear layer but the output head, verl's
    default) or a list such as [q_proj, v_proj]."""


class ActorConfig(_Strict):
    strategy: Literal["torch", "fsdp", "megatron"] = "torch"
    """Optimization backend: 'torch' (DDP over gloo/NCCL), 'fsdp' (torch FSDP2 `fully_shard`, parameters and
    optimizer state sharded over the ranks; stages/train/fsdp.py) or 'megatron' (Megatron-Core TP/PP/DP)."""
    mixed_precision: MixedPrecisionConfig = MixedPrecisionConfig()
    """Forward compute dtype of the actor (and of its old log-probs and the reference model)."""
    megatron: MegatronConfig = MegatronConfig()
    """Parallel layout of the Megatron backend; ignored by 'torch'."""
    ppo_mini_batch_size: int = 32
    """Prompts per optimizer step (verl semantics: multiplied by rollout.n for rollouts)."""
    ppo_micro_batch_size: int = 64
    """Rollouts per forward/backward (gradient accumulation inside a mini-batch), per worker."""
    use_dynamic_bsz: bool = False
    """verl's name: micro-batches cut by a token budget instead of ppo_micro_batch_size rows, each packed into one
    row without padding (stages/train/packing.py), in the update and the log-prob passes (old and reference
    log-probs); the loss is the padded path's up to float rounding. torch and fsdp strategies."""
    ppo_max_token_len_per_gpu: int = Field(16384, gt=0)
    """With use_dynamic_bsz: real tokens (prompt + response) per update micro-batch, per worker (verl's default)."""
    log_prob_max_token_len_per_gpu: int = Field(16384, gt=0)
    """With use_dynamic_bsz: real tokens per micro-batch of the old and reference log-prob passes (verl keeps
    one under rollout and one under ref; rlake one for both)."""
    ppo_epochs: int = 1
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    """Defaults to clip_ratio."""
    clip_ratio_high: float | None = None
    """Defaults to clip_ratio; larger values give DAPO's clip-higher."""
    clip_ratio_c: float = 3.0
    """Dual-clip lower bound for negative advantages."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    """Aggregation of every loss term (policy loss, entropy bonus, KL loss) over the mini-batch, as verl >= 0.8:
    token-mean over its counted tokens, seq-mean-* over its rows with a counted token, whatever the micro-batch
    and data-parallel split (gspo always uses seq-mean-token-mean, as verl)."""
    loss_scale_factor: int | None = None
    """seq-mean-token-sum-norm's constant length (Dr.GRPO); None: data.max_response_length, the length verl pads
    responses to."""
    entropy_coeff: float = 0.0
    policy_loss: PolicyLossConfig = PolicyLossConfig()
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: Literal[
        "k1", "abs", "k2", "mse", "k3", "low_var_kl", "k1+", "abs+", "k2+", "mse+", "k3+", "low_var_kl+"
    ] = "low_var_kl"
    num_workers: int = 2
    """Trainer ranks: persistent Ray actors in one gloo group (data parallel, or the TP x PP x DP grid)."""
    worker_backend: Literal["worker_group", "ray_train"] = "worker_group"
    """What runs the trainer ranks: 'worker_group', rlake's named Ray actors (stages/workers/group.py), or
    'ray_train', the workers of one Ray Train run kept for the whole rlake run, which Ray Train restarts by itself
    when a rank is lost (stages/workers/train_group.py). Same worker code, policy and optimizer resident either
    way; 'ray_train' takes no GPU pool (docs/architecture.md, "The update on Ray Train")."""
    ray_train_max_failures: int = Field(2, ge=0)
    """With worker_backend='ray_train': restarts of the rank group Ray Train makes by itself (its
    FailureConfig.max_failures) before the failure reaches rlake's own iteration retry."""
    optim: OptimConfig = OptimConfig()
    lora: LoraConfig = LoraConfig()
    """LoRA fine-tuning of the actor (rank 0: off); torch strategy only."""

    @model_validator(mode="after")
    def _lora_needs_torch(self) -> ActorConfig:
        if self.lora.rank > 0 and self.strategy != "torch":
            raise ValueError(
                f"actor.lora.rank={self.lora.rank} is not supported with actor.strategy='{self.strategy}', because "
                "rlake wraps the policy in peft adapters only in the torch (DDP) trainer; the FSDP2 sharding and the "
                "Megatron HF<->GPT conversion of rlake know plain HF parameters only; use actor.strategy='torch' "
                "with LoRA, or actor.lora.rank=0 (full fine-tuning) with fsdp/megatron."
            )
        return self

    @model_validator(mode="after")
    def _dynamic_bsz_needs_torch(self) -> ActorConfig:
        if self.use_dynamic_bsz and self.strategy == "megatron":
            raise ValueError(
                "actor.use_dynamic_bsz=True is not supported with actor.strategy='megatron', because rlake packs "
                "sequences in the HF model's forward (torch and fsdp) and its Megatron schedule takes padded "
                "micro-batches of a fixed size; use actor.strategy='torch' or 'fsdp', or actor.use_dynamic_bsz=False."
            )
        return self

    @model_validator(mode="after")
    def _megatron_is_float32(self) -> ActorConfig:
        mp = self.mixed_precision
        if self.strategy == "megatron" and mp.param_dtype != "float32":
            raise ValueError(
                f"actor.mixed_precision.param_dtype='{mp.param_dtype}' (master_weights='{mp.master_weights}') is "
                "not supported with actor.strategy='megatron', because rlake's Megatron update is a plain torch "
                "AdamW over float32 GPTModel shards whose state it converts to and from the torch backend's "
                "checkpoint format (stages/train/megatron/state.py): megatron-core's own fp32 masters (bf16=True) "
                "live in its DistributedDataParallel grad buffers and DistributedOptimizer, whose sharded state "
                "that conversion does not know; and autocast over float32 parameters fails on the CPU in "
                "megatron's linear backward (bf16 grad @ float32 weight); use actor.strategy='torch' or 'fsdp' "
                "for bf16 (either master_weights), or param_dtype='float32' with megatron."
            )
        return self

    @model_validator(mode="after")
    def _fp32_master_without_lora(self) -> ActorConfig:
        if self.mixed_precision.master_weights == "fp32_master" and self.lora.rank > 0:
            raise ValueError(
                f"actor.mixed_precision.master_weights='fp32_master' is not supported with actor.lora.rank="
                f"{self.lora.rank}, because only the adapters would get float32 masters while the frozen base "
                "would be held in bf16, and the merged checkpoint would lose the base's float32 weights; use "
                "master_weights='autocast' with LoRA, or actor.lora.rank=0."
            )
        return self
