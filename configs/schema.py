"""rlake run configuration: the single source of truth.

Every YAML file in `configs/` mirrors `RunConfig` one-to-one. Names follow verl where a verl
knob exists (`train_batch_size`, `rollout.n`, `ppo_mini_batch_size`, `clip_ratio_low`, ...), so a
verl user finds them where they expect. Models are frozen and forbid unknown keys, so a typo fails
at load time with the offending key named.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SyntheticTaskConfig(_Strict):
    """Locally generated digit-arithmetic task, written in verl's parquet format."""

    num_train: int = 2000
    """Training prompts generated."""
    num_val: int = 128
    """Held-out validation prompts (disjoint operand pairs)."""
    max_operand: int = 49
    """Operands are drawn from [0, max_operand]."""
    operators: list[Literal["+", "-"]] = ["+"]
    """Operators used in the problems."""
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
    """SFT steps on a disjoint synthetic split, so RL starts from a model that knows the format."""
    warmstart_lr: float = 3e-3
    warmstart_batch_size: int = 64
    warmstart_answer_formats: list[str] = ["#### {answer}"]
    """Response templates of the warm start, cycled over examples. Mixing formats the reward does not
    accept (e.g. "{answer}") leaves RL a format to discover, as in the first phase of GSM8K runs."""


class ModelConfig(_Strict):
    path: str = "tiny"
    """'tiny' builds TinyModelConfig in-process; otherwise a local HF checkpoint directory."""
    tiny: TinyModelConfig = TinyModelConfig()
    dtype: Literal["float32", "bfloat16"] = "float32"


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
    """Sampling seed; iteration i uses seed + i."""
    num_workers: int = 1
    """Ray Data actors running an engine each."""
    micro_batch_size: int = 256
    """Sequences per generate call inside an actor."""
    stop: list[str] = []
    """Extra stop strings (the EOS token always stops)."""


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


class ActorConfig(_Strict):
    strategy: Literal["torch", "megatron"] = "torch"
    """Optimization backend: 'torch' (DDP over gloo/NCCL) or 'megatron' (Megatron-Core TP/PP/DP)."""
    megatron: MegatronConfig = MegatronConfig()
    """Parallel layout of the Megatron backend; ignored by 'torch'."""
    ppo_mini_batch_size: int = 32
    """Prompts per optimizer step (verl semantics: multiplied by rollout.n for rollouts)."""
    ppo_micro_batch_size: int = 64
    """Rollouts per forward/backward (gradient accumulation inside a mini-batch), per worker."""
    ppo_epochs: int = 1
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    """Defaults to clip_ratio."""
    clip_ratio_high: float | None = None
    """Defaults to clip_ratio; larger values give DAPO's clip-higher."""
    clip_ratio_c: float = 3.0
    """Dual-clip lower bound for negative advantages."""
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    entropy_coeff: float = 0.0
    policy_loss: PolicyLossConfig = PolicyLossConfig()
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: Literal["k1", "abs", "k2", "mse", "k3", "low_var_kl"] = "low_var_kl"
    num_workers: int = 2
    """Ray Train workers (gloo data parallel)."""
    optim: OptimConfig = OptimConfig()


GROUP_ESTIMATORS = ("grpo", "rloo", "opo", "reinforce_plus_plus_baseline")


class AlgorithmConfig(_Strict):
    adv_estimator: Literal["grpo", "rloo", "opo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"] = "grpo"
    """verl's estimator names (stages/algos/advantages.py); gae and remax need a critic / greedy
    baseline stage that is not wired yet."""
    norm_adv_by_std_in_grpo: bool = True
    """False gives Dr.GRPO's unscaled advantage."""
    gamma: float = 1.0
    """Discount of token-level returns (reinforce_plus_plus)."""


class RewardConfig(_Strict):
    format_score: float = 0.0
    """Score for a well-formed but wrong answer (verl's gsm8k format_score)."""
    score: float = 1.0
    """Score for a correct answer."""
    num_workers: int = 2
    """Parallel Ray Data workers scoring rewards."""
    on_error: Literal["raise", "flag"] = "raise"
    """A reward function that raises or returns NaN: stop with the row named, or flag the row
    (reward NaN, reward_error set) and let the blocking asset check stop the iteration."""


class TrainerConfig(_Strict):
    project_name: str = "rlake"
    """MLflow experiment name."""
    experiment_name: str = "tiny_cpu"
    """Run name; the rlake run id defaults to it."""
    run_id: str | None = None
    """Explicit run id; `rlake train` generates one from experiment_name when unset."""
    total_training_steps: int = 10
    """RL iterations."""
    save_freq: int = 1
    """Keep a policy checkpoint every save_freq iterations (the latest is always kept)."""
    test_freq: int = 5
    """Validate every test_freq iterations (and before the first and after the last)."""
    output_dir: str = "rlake_output"
    """Root for Delta tables, checkpoints and the MLflow store."""
    mlflow_tracking_uri: str | None = None
    """Defaults to sqlite:///{output_dir}/mlflow.db."""


class RayConfig(_Strict):
    address: str | None = None
    """Attach to a running cluster; None starts a local one."""
    num_cpus: int | None = None
    """CPUs of the local cluster; None uses all."""


class RunConfig(_Strict):
    seed: int = 0
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    rollout: RolloutConfig = RolloutConfig()
    actor: ActorConfig = ActorConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    reward: RewardConfig = RewardConfig()
    trainer: TrainerConfig = TrainerConfig()
    ray: RayConfig = RayConfig()

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
        micro = (self.actor.megatron.micro_batch_size or self.actor.ppo_micro_batch_size) if megatron \
            else self.actor.ppo_micro_batch_size
        if (rollouts // dp) % micro != 0:
            raise ValueError(
                f"the micro-batch size ({micro}) must divide the {rollouts // dp} rollouts each "
                "data-parallel worker gets per mini-batch (ppo_mini_batch_size x rollout.n / DP); pick a divisor."
            )
        return self

    @property
    def run_id(self) -> str:
        return self.trainer.run_id or self.trainer.experiment_name

    def config_hash(self) -> str:
        """Stable 12-hex hash of the config, excluding the run id (same settings, same hash)."""
        data = self.model_dump(mode="json")
        data["trainer"].pop("run_id", None)
        blob = json.dumps(data, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ValueError(f"override '{dotted}': '{key}' is not a section")
    node[keys[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load a YAML config and apply `key.sub=value` overrides (values parsed as YAML)."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"config file '{p}' does not exist; pass a path under configs/")
        tree = yaml.safe_load(p.read_text()) or {}
        if not isinstance(tree, dict):
            raise ValueError(f"config file '{p}' must hold a mapping at top level, got {type(tree).__name__}")
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override '{item}' must look like key.sub=value")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), yaml.safe_load(raw))
    return RunConfig.model_validate(tree)


def dump_defaults() -> str:
    """YAML of RunConfig() - the generated reference kept in configs/_defaults.yaml."""
    return yaml.safe_dump(RunConfig().model_dump(mode="json"), sort_keys=False)


__all__ = ["RunConfig", "load_config", "dump_defaults", "Field"]
