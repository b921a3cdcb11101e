"""rlake run configuration: the single source of truth.

`configs/tiny_cpu.yaml` mirrors `RunConfig` one-to-one; the other YAMLs are overlays on it
(`defaults: [tiny_cpu]` plus their differences; configs/compose.py). Names follow verl where a
verl knob exists (`train_batch_size`, `rollout.n`, `ppo_mini_batch_size`, `clip_ratio_low`, ...),
so a verl user finds them where they expect (verl's `actor_rollout_ref.rollout.n` is accepted too).
Models are frozen and forbid unknown keys, so a typo fails at load time with the offending key named.

Each section's models live in configs/sections/<section>.py; this module holds RunConfig, its cross-section
rules and the loading, and re-exports every section class, so `from configs.schema import X` works for all.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import yaml
from pydantic import Field, model_validator

from configs import compose
from configs.secrets import refuse_uri_passwords
from configs.sections.actor import (
    ActorConfig,
    LoraConfig,
    MegatronConfig,
    MixedPrecisionConfig,
    OptimConfig,
    PolicyLossConfig,
)
from configs.sections.algorithm import (
    GROUP_ESTIMATORS,
    ROLLOUT_RS_OPTIONS,
    AlgorithmConfig,
    DistillationConfig,
    FilterGroupsConfig,
    KLControlConfig,
    RolloutCorrectionConfig,
)
from configs.sections.base import CREDENTIAL_KEY, _Strict
from configs.sections.critic import CriticConfig
from configs.sections.data import DataConfig, SyntheticTaskConfig
from configs.sections.model import ModelConfig, TinyModelConfig
from configs.sections.ray import RAY_ROLES, RayConfig
from configs.sections.reward import (
    DEFAULT_JUDGE_TEMPLATE,
    JUDGE_PLACEHOLDERS,
    CustomRewardFunctionConfig,
    JudgeConfig,
    OverlongBufferConfig,
    RewardConfig,
    RewardModelConfig,
)
from configs.sections.rollout import MultiTurnConfig, RolloutConfig, ValKwargsConfig
from configs.sections.storage import StorageConfig
from configs.sections.trainer import RUN_NAME, TrainerConfig


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


__all__ = [
    "RunConfig",
    "load_config",
    "dump_defaults",
    "Field",
    "ActorConfig",
    "AlgorithmConfig",
    "CREDENTIAL_KEY",
    "CriticConfig",
    "CustomRewardFunctionConfig",
    "DEFAULT_JUDGE_TEMPLATE",
    "DataConfig",
    "DistillationConfig",
    "FilterGroupsConfig",
    "GROUP_ESTIMATORS",
    "JUDGE_PLACEHOLDERS",
    "JudgeConfig",
    "KLControlConfig",
    "LoraConfig",
    "MegatronConfig",
    "MixedPrecisionConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "OptimConfig",
    "OverlongBufferConfig",
    "PolicyLossConfig",
    "RAY_ROLES",
    "ROLLOUT_RS_OPTIONS",
    "RUN_NAME",
    "RayConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "StorageConfig",
    "SyntheticTaskConfig",
    "TinyModelConfig",
    "TrainerConfig",
    "ValKwargsConfig",
]
