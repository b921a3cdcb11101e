"""Critic (value model) of PPO with GAE: model, per-token values, clipped-value-loss update.

Shape legend: B prompts, G samples per prompt, N = B*G rollouts, P prompt len,
L response len, T = P+L. Masks are float {0,1}, 1 = counted in the loss.

Choices (verl semantics):
- The critic is a plain HF `AutoModelForTokenClassification` with num_labels=1 and dropout 0: the
  policy's backbone (its `model.*` weights) plus a new Linear(hidden, 1) head `score`, seeded. It is
  saved as an HF directory (safetensors + config + tokenizer) with `optimizer.pt` and
  `critic_metrics.json` beside, so `AutoModelForTokenClassification.from_pretrained(dir)` reopens it.
- Version 0 is initialised from policy version 0 (verl: critic.model.path defaults to the actor's).
  Version v scores iteration v's rollouts; iteration v's update writes v+1 (as the policy).
- Alignment: values[:, t] is the head's output at position P-1+t, the same position whose logits
  predict response token t: the value of the state in which token t is chosen (verl
  `values[:, -response_length - 1:-1]`); it estimates the return from token t on.
- Values and the update run on one torch thread (single process, no DDP). Measured on the 2-core box
  under load, 512 rollouts of the tiny_cpu model: values 0.22 s and the update 0.86 s on one thread,
  5.0 s and 21 s on two (thread contention).
- The update is the PPO loop of the actor (stages.train.ppo_loop): critic.ppo_epochs x mini-batches of
  critic.ppo_mini_batch_size x rollout.n rollouts, gradient accumulation over critic.ppo_micro_batch_size
  rollouts, clipped value loss (stages.algos.value) against the rollout-time values, grad clip
  critic.optim.grad_clip.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import torch
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification
from transformers.utils import logging as hf_logging

from configs.schema import CriticConfig
from stages.algos.critic_moments import CriticDataMoments
from stages.algos.losses import GlobalBatch
from stages.io.checkpoints import OPTIMIZER_FILE, checkpoint_target, resolve_model_dir, save_optimizer_state, writing
from stages.models.policy import load_tokenizer
from stages.train.batching import (
    loss_mask,
    masked_fill_zero,
    model_device,
    pad_rollouts,
    ragged_to_padded,
    row_masks,
    select_rows,
    to_device,
)
from stages.train.optim import CRITIC_GRAD_ERROR, clip_grads, make_optimizer, restore_optimizer
from stages.train.ppo_loop import MetricAccumulator, accumulate_grads, critic_loss, ppo_loop

__all__ = [
    "METRICS_FILE",
    "OPTIMIZER_FILE",
    "compute_values",
    "critic_data_metrics",
    "critic_update",
    "init_critic",
    "load_critic",
    "prune_critics",
    "ragged_to_padded",
    "require_critic",
    "response_values",
    "run_critic_update",
    "torch_threads",
    "update_rows",
    "values_frame",
]

METRICS_FILE = "critic_metrics.json"


@contextmanager
def torch_threads(n: int):
    """Run the block with n torch threads, restoring the previous count."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def _quiet_transformers():
    """transformers logs errors only inside the block (no warning about the new value head)."""
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def init_critic(policy_dir: str | Path, out_dir: str | Path, *, seed: int = 0) -> str | Path:
    """Write critic version 0: policy_dir's backbone + a fresh scalar head (out_dir: a checkpoint_target,
    committed to the run's store, or a directory written whole; stages.io.checkpoints.writing)."""
    policy_dir, out = resolve_model_dir(policy_dir), out_dir
    tok = load_tokenizer(policy_dir)
    config = AutoConfig.from_pretrained(policy_dir, num_labels=1, local_files_only=True)
    config.classifier_dropout = 0.0
    config.architectures = None  # from_config/save_pretrained fill in the token-classification class
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, local_files_only=True)
    with torch.random.fork_rng():  # a seeded head without touching the caller's RNG
        torch.manual_seed(seed)
        try:
            critic = AutoModelForTokenClassification.from_config(config)
        except ValueError as exc:
            raise ValueError(
                f"cannot build a value model from the policy at '{policy_dir}' ({config.model_type}): "
                f"transformers has no token-classification head for it ({exc}); PPO with GAE needs "
                "one, so pick a model type that has one (Qwen2, Llama, ...) or another adv_estimator"
            ) from exc
    prefix = critic.base_model_prefix
    critic.get_submodule(prefix).load_state_dict(policy.get_submodule(policy.base_model_prefix).state_dict())
    return _save(critic, tok, out, metrics={})


def require_critic(store, version: int, *, seed: int, needed_by: str) -> Path:
    """Critic `version` of the run (a stages.io.checkpoints.ModelStore); version 0 is created from policy
    version 0 on first use, any later one must have been written by iteration version-1's update."""
    if version == 0 and store.manifest(0, "critic") is None:
        init_critic(store.require(0, needed_by=needed_by), checkpoint_target(store, "critic", 0), seed=seed)
    return store.require(version, needed_by=needed_by, kind="critic")


def load_critic(critic_dir: str | Path):
    """(value model in eval mode, tokenizer) of a critic directory written by init_critic / the update."""
    path = resolve_model_dir(critic_dir)  # a checkpoint reference: this node's cached copy
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"'{path}' is not a critic checkpoint (no config.json); critic version 0 is created "
            "from policy version 0 by the values asset of iteration 0: materialize it first."
        )
    with _quiet_transformers():
        model = AutoModelForTokenClassification.from_pretrained(path, local_files_only=True)
    if model.config.num_labels != 1:
        raise ValueError(
            f"critic at '{path}' has num_labels={model.config.num_labels}; a value model needs 1. "
            "Delete it and let iteration 0 re-create it from the policy."
        )
    return model.eval(), load_tokenizer(path)


def _save(model, tok, out: str | Path, *, metrics: dict, optimizer=None, scheduler=None) -> str | Path:
    """The critic checkpoint `out` (HF model + tokenizer, optimizer state when given, metrics): committed to the
    run's store for a checkpoint_target, else a directory written whole or not at all."""
    with writing(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if optimizer is not None:
            save_optimizer_state(tmp, optimizer.state_dict(), scheduler.state_dict())
        (tmp / METRICS_FILE).write_text(json.dumps(metrics, indent=1, sort_keys=True))
    return out


def response_values(model, batch: dict) -> Tensor:
    """Values of the states before each response token: (N, L) (see the module docstring)."""
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        use_cache=False,
    )
    p_len, l_len = batch["prompt_len"], batch["responses"].shape[1]
    return out.logits[:, p_len - 1 : p_len - 1 + l_len, 0].float()  # (N, L)


@torch.no_grad()
def compute_values(model, prompts, responses, pad_id: int, micro_batch_size: int) -> list[list[float]]:
    """Per-token values of each rollout's response tokens: N lists of len(response) floats."""
    batch = to_device(pad_rollouts(prompts, responses, pad_id), model_device(model))
    n = batch["input_ids"].shape[0]
    vals = torch.cat(
        [
            response_values(model, select_rows(batch, torch.arange(s, min(s + micro_batch_size, n))))
            for s in range(0, n, micro_batch_size)
        ]
    )  # (N, L)
    return [vals[i, : len(r)].tolist() for i, r in enumerate(responses)]


def values_frame(
    rollouts: pd.DataFrame,
    critic_dir: str | Path,
    *,
    critic_version: int,
    micro_batch_size: int,
    threads: int = 1,
    device: torch.device | str = "cpu",
) -> pd.DataFrame:
    """Rows of the `values` table: rollout_id, critic_version, values (one float per response token), computed
    on `device` (the critic worker's)."""
    model, tok = load_critic(critic_dir)
    model.to(device)
    with torch_threads(threads):
        vals = compute_values(
            model,
            [list(p) for p in rollouts["prompt_token_ids"]],
            [list(r) for r in rollouts["response_token_ids"]],
            tok.pad_token_id,
            micro_batch_size,
        )
    return pd.DataFrame(
        {"rollout_id": rollouts["rollout_id"].to_numpy(), "critic_version": critic_version, "values": vals}
    )


def critic_update(
    model, optimizer, scheduler, rows: dict, critic_cfg: CriticConfig, *, n_per_prompt: int, pad_id: int, seed: int = 0
) -> dict[str, float]:
    """One iteration's critic optimization (single process) through the PPO loop (stages.train.ppo_loop).

    Args:
        rows: prompt_token_ids, response_token_ids, values (rollout-time values), returns (GAE
            returns): N ragged lists each; optional response_mask (N 0/1 lists or None, row_masks): observation
            tokens (0) get no value loss and do not count in its normalisation.
        critic_cfg: configs.schema.CriticConfig.
    Returns:
        metrics averaged over optimizer steps (critic/vf_loss: the mini-batch's loss): critic/vf_loss,
        critic/vf_clipfrac, critic/vpred_mean,
        critic/grad_norm, critic/lr.
    """
    batch = pad_rollouts(
        rows["prompt_token_ids"], rows["response_token_ids"], pad_id, row_masks(rows.get("response_mask"))
    )
    n, width = batch["responses"].shape
    batch["old_values"] = masked_fill_zero(ragged_to_padded(rows["values"], width), batch["response_mask"])  # (N, L)
    batch["returns"] = masked_fill_zero(ragged_to_padded(rows["returns"], width), batch["response_mask"])  # (N, L)
    batch = to_device(batch, model_device(model))
    mini_size, micro = critic_cfg.ppo_mini_batch_size * n_per_prompt, critic_cfg.ppo_micro_batch_size
    metrics = MetricAccumulator()

    def loss_fn(mb: dict, global_batch: GlobalBatch) -> tuple[Tensor, dict[str, float]]:
        return critic_loss(response_values(model, mb), mb, critic_cfg, global_batch)  # values (n_mb, L)

    model.train()
    ppo_loop(
        n,
        mini_batch_size=mini_size,
        micro_batch_size=micro,
        epochs=critic_cfg.ppo_epochs,
        seed=seed,
        backward=lambda micro_idx: accumulate_grads(batch, micro_idx, loss_fn, metrics),
        finish_grads=lambda: clip_grads(model, critic_cfg.optim.grad_clip),
        optimizer=optimizer,
        scheduler=scheduler,
        metrics=metrics,
        prefix="critic",
        error=CRITIC_GRAD_ERROR,
    )
    model.eval()
    return metrics.means()


def update_rows(advantages: pd.DataFrame, values: pd.DataFrame) -> dict:
    """Critic-update rows from the iteration's advantages (returns) and values tables, by rollout_id."""
    df = advantages.merge(values[["rollout_id", "values"]], on="rollout_id", how="left", validate="one_to_one")
    missing = df.loc[df["values"].isna(), "rollout_id"].tolist()[:10]
    if missing:
        raise ValueError(
            f"rollouts {missing} have advantages but no row in the values table; re-materialize "
            "`values` and `advantages` of this iteration so both come from the same rollouts"
        )
    df = df.sort_values("rollout_id").reset_index(drop=True)
    rows = {
        k: [list(x) for x in df[c]]
        for k, c in (
            ("prompt_token_ids", "prompt_token_ids"),
            ("response_token_ids", "response_token_ids"),
            ("values", "values"),
            ("returns", "returns"),
        )
    }
    return rows | {"response_mask": row_masks(df.get("response_mask"))}


def run_critic_update(
    critic_dir: str | Path,
    out_dir: str | Path,
    rows: dict,
    critic_cfg: CriticConfig,
    *,
    n_per_prompt: int,
    seed: int,
    threads: int = 1,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """Load critic version v (and its optimizer state) onto `device`, update it on `rows`, write version v+1 to
    out_dir."""
    model, tok = load_critic(critic_dir)
    model.to(device)
    opt, sched = make_optimizer(model, critic_cfg.optim)
    restore_optimizer(opt, sched, resolve_model_dir(critic_dir))
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch_threads(threads):
        metrics = critic_update(
            model, opt, sched, rows, critic_cfg, n_per_prompt=n_per_prompt, pad_id=tok.pad_token_id, seed=seed
        )
    metrics["timing_s/critic_update"] = time.perf_counter() - t0
    _save(model, tok, out_dir, metrics=metrics, optimizer=opt, scheduler=sched)
    return metrics


def critic_data_metrics(advantages: pd.DataFrame, values: pd.DataFrame) -> dict[str, float]:
    """verl's compute_data_metrics critic part over the model's response tokens (observation tokens left out):
    critic/values|returns|advantages/mean|max|min and critic/vf_explained_var = 1 - Var(returns - values) /
    Var(returns) (stages.algos.critic_moments), of frames held here; the iteration_metrics stage streams the
    partitions instead (stages.iteration_metrics.streamed_critic_data_metrics)."""
    df = advantages.merge(values[["rollout_id", "values"]], on="rollout_id", how="inner")
    lengths = df["response_token_ids"].map(len).tolist()
    width = max(1, max(lengths, default=1))
    counted = loss_mask(lengths, width, row_masks(df.get("response_mask"))) > 0  # (N, L)
    moments = CriticDataMoments()
    moments.add(
        *(ragged_to_padded(df[col], width)[counted].numpy() for col in ("values", "returns", "token_advantages"))
    )
    return moments.metrics()


def prune_critics(store, keep_every: int, latest: int) -> list[int]:
    """Retract critic versions not a multiple of keep_every, except 0 and the newest two (as policies)."""
    return store.prune(keep_every, latest, kind="critic")
