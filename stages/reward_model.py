"""The scored_rollouts stage's reward model (reward.reward_model): a discriminative RM scores every
training rollout, beside the rule reward.

Flow: assets/scored_rollouts.py `materialize` -> `score_partition` -> `score_rollouts` (rule reward,
stages/scored_rollouts.py) -> when reward.reward_model.enable, `reward_model_scores(cfg, rollouts)`, which
splits the rollouts over the run's "reward_model" worker group and calls `RewardModelWorker.compute_rm_score`
(stages/workers/reward_model_worker.py: tokenization, truncation, the score at the last token) on each
rank; the workers load the model once and keep it for the whole run -> `combine_rm_scores`. Of the rollouts'
token columns the stage reads only the ones the RM reads (`reward_model_reads`: the policy's token ids, or none).

Choices:
- combine='replace' is verl's behaviour: with `rm_scores` in the batch, verl's reward managers (naive,
  dapo, ...: AbstractRewardManager._extract_reward_from_rm_scores) and the trainer's
  _compute_or_extract_reward return the RM scores as the reward and never call the rule function.
  combine='add' (reward = rule score + rm_score) is rlake's own. In both, `score` keeps the rule score
  (stored, and what the DAPO filter's 'acc' / 'score' metrics use) and the overlong penalty is added on
  top (verl's dapo manager returns the RM scores without it). Under replace a row whose rule function
  failed (reward.on_error='flag') keeps a finite reward: the rule score is not part of it.
- rm_version names the RM the scores came from: the checkpoint's id (stages.io.checkpoints.checkpoint_id)
  when it has one, else `sha256:` + 16 hex digits of its config.json and of each weight file's name, size
  and first and last MiB (a copy of the same checkpoint keeps its version; a change to weights only in
  the middle of a large file would not change it; hashing whole files would cost seconds per GB each
  iteration).
- Validation (stages/evaluate.py) keeps scoring with the rule reward only, as verl validates with the
  rule-based reward alone.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from configs.schema import RunConfig
from stages.io.checkpoints import model_version
from stages.models.policy import load_tokenizer
from stages.models.smollm2 import resolve_model_path
from stages.models.tiny import build_char_tokenizer
from stages.workers.group import WorkerGroup, engine_threads, worker_group
from stages.workers.placement import GpuPool
from stages.workers.reward_model_worker import POLICY_ID_READS, TEXT_READS, RewardModelWorker
from stages.workers.sharded import local_group, sharded_call
from stages.workers.tasks import MAX_ACTOR_RESTARTS

ROLE = "reward_model"
"""The worker group's role (its actors are named rlake:reward_model:<build>:<rank>)."""


def check_reward_model_dir(path: str | Path | None) -> dict:
    """config.json of a reward-model checkpoint dir (a *ForSequenceClassification with one label and a
    tokenizer), or a what / why / fix error; returns the config dict."""
    p = Path(path or "")
    what = f"reward.reward_model.model_path '{path}'"
    if not path or not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"{what} is not an HF checkpoint directory (no config.json); the reward model is loaded from a "
            "local directory written by save_pretrained: point model_path at one."
        )
    conf = json.loads((p / "config.json").read_text())
    archs = conf.get("architectures") or []
    labels = len(conf.get("id2label") or {}) or conf.get("num_labels") or 2  # HF's default is 2 labels
    if not any(a.endswith("ForSequenceClassification") for a in archs) or labels != 1:
        raise ValueError(
            f"{what} holds a {archs or conf.get('model_type')} model with {labels} label(s), not a reward model: "
            "rlake scores a prompt + response with one scalar head (AutoModelForSequenceClassification, "
            "num_labels=1), which a causal LM or a multi-label classifier lacks; point model_path at a "
            "*ForSequenceClassification checkpoint with one label (e.g. one trained by TRL's RewardTrainer)."
        )
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise FileNotFoundError(
            f"{what} has no tokenizer (tokenizer.json / tokenizer_config.json), which the reward model needs to "
            "read the rollouts' text; save the tokenizer with it (tokenizer.save_pretrained(model_path))."
        )
    return conf


def shares_policy_tokenizer(cfg: RunConfig) -> bool:
    """Whether the RM's tokenizer is the policy's: it reads every id of the policy's vocabulary as the same
    token (a tokenizer loaded from a checkpoint may add a token after them, e.g. Qwen2's unk). Then the
    policy's token ids are scored as they are, else the rollouts' text is re-tokenized
    (stages/workers/reward_model_worker.py). Both tokenizers are loaded once per process and paths."""
    return _same_vocabulary(cfg.model.path, cfg.model.tiny.tool_tokens, cfg.reward.reward_model.model_path)


@functools.lru_cache(maxsize=8)
def _same_vocabulary(policy_path: str, tool_tokens: bool, rm_path: str) -> bool:
    policy = (
        build_char_tokenizer(tool_tokens=tool_tokens)
        if policy_path == "tiny"
        else load_tokenizer(resolve_model_path(policy_path))
    )
    rm_vocab = load_tokenizer(rm_path).get_vocab()
    return all(rm_vocab.get(token) == i for token, i in policy.get_vocab().items())


def reward_model_reads(cfg: RunConfig) -> tuple[str, ...]:
    """The rollouts columns reward_model_scores reads (RewardModelWorker.compute_rm_score): rollout_id and the
    policy's prompt_token_ids and response_token_ids when the RM shares the policy's tokenizer (POLICY_ID_READS),
    else prompt_text, response_text and finish_reason (TEXT_READS); never rollout_logprobs, response_mask or turns.
    A model_path that is no reward-model checkpoint fails here (check_reward_model_dir), before any read."""
    check_reward_model_dir(cfg.reward.reward_model.model_path)
    return POLICY_ID_READS if shares_policy_tokenizer(cfg) else TEXT_READS


def _worker_kwargs(cfg: RunConfig) -> dict:
    rm = cfg.reward.reward_model
    check_reward_model_dir(rm.model_path)
    return {
        "model_dir": str(Path(rm.model_path).resolve()),
        "micro_batch_size": rm.micro_batch_size,
        "max_length": rm.max_length,
        "reuse_policy_ids": shares_policy_tokenizer(cfg),
    }


def reward_model_group(cfg: RunConfig, num_workers: int, kwargs: dict | None = None) -> WorkerGroup:
    """The run's "reward_model" group of num_workers ranks: created on first use, then found by name."""
    kwargs = kwargs or _worker_kwargs(cfg)
    return worker_group(
        RewardModelWorker,
        ROLE,
        num_workers,
        threads=engine_threads(num_workers),
        gpus=GpuPool.of(cfg.trainer),
        **kwargs,
    )


def reward_model_scores(cfg: RunConfig, rollouts: pd.DataFrame, *, use_ray: bool = True) -> pd.DataFrame:
    """Rows (rollout_id, rm_score, rm_version) of the rollouts, sorted by rollout_id, on
    rollout.num_workers "reward_model" workers (as the reference policy's); use_ray=False scores in this
    process. A killed worker is replaced and the call retried up to MAX_ACTOR_RESTARTS times."""
    rm = cfg.reward.reward_model
    if not rm.enable:
        raise ValueError("reward_model_scores needs reward.reward_model.enable=true (and model_path); set both.")
    if not len(rollouts):
        raise ValueError("reward_model_scores got no rollouts: the rollouts partition is empty")
    kwargs = _worker_kwargs(cfg)
    workers = max(1, min(cfg.rollout.num_workers, len(rollouts)))
    out = sharded_call(
        lambda: (
            reward_model_group(cfg, workers, kwargs)
            if use_ray
            else local_group(RewardModelWorker, torch.get_num_threads(), **kwargs)
        ),
        RewardModelWorker.compute_rm_score,
        rollouts,
        lambda shard: (shard,),
        retries=MAX_ACTOR_RESTARTS,
    )
    bad = out.loc[~np.isfinite(out["rm_score"].to_numpy(dtype=np.float64)), "rollout_id"].tolist()
    if bad:
        raise ValueError(
            f"the reward model at {rm.model_path} gave non-finite scores to rollouts {bad[:10]}; its weights or "
            "dtype are broken: check the checkpoint (e.g. score a few texts with it in transformers)."
        )
    out = out.assign(rm_version=model_version(rm.model_path))
    return out.sort_values("rollout_id").reset_index(drop=True)


def combine_rm_scores(scored: pd.DataFrame, rm: pd.DataFrame, combine: str) -> pd.DataFrame:
    """scored (score_rollouts' output) with rm's rm_score and rm_version columns, and `reward` set by
    combine: 'replace' -> rm_score + overlong_penalty (verl), 'add' -> score + rm_score + overlong_penalty.
    `score` keeps the rule score; the rows keep scored's order."""
    if combine not in ("replace", "add"):
        raise ValueError(f"Unknown reward.reward_model.combine '{combine}'. Valid: ['add', 'replace']")
    missing = sorted(set(scored["rollout_id"]) - set(rm["rollout_id"]))
    if missing or len(rm) != len(scored):
        raise ValueError(
            f"reward-model scores do not match the scored rollouts one to one ({len(rm)} scores for {len(scored)} "
            f"rollouts; unscored rollout_ids {missing[:10]}): score the same rollouts partition with both."
        )
    out = scored.drop(columns=["rm_score", "rm_version"], errors="ignore").merge(
        rm[["rollout_id", "rm_score", "rm_version"]], on="rollout_id", how="left", validate="one_to_one"
    )
    base = out["rm_score"] if combine == "replace" else out["score"] + out["rm_score"]
    penalty = out["overlong_penalty"] if "overlong_penalty" in out else 0.0
    return out.assign(reward=(base + penalty).astype(np.float64))
