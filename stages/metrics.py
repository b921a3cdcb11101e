"""Iteration metrics with verl's names (critic/score/mean, response_length/mean, ...)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from configs.schema import RunConfig
from stages.algos.val_metrics import process_validation_metrics, val_metric_names
from stages.dag import STEP_TIMINGS
from stages.filter_groups import split_baseline_rows
from stages.old_logprobs import probs_gap
from stages.train.batching import row_masks
from stages.train.critic import critic_metrics


def _stats(prefix: str, values: np.ndarray) -> dict[str, float]:
    """mean / max / min over the finite values (a flagged reward, NaN, is left out as the update leaves it out)."""
    values = np.asarray(values, dtype=np.float64)
    values = values[np.isfinite(values)] if len(values) else values
    if not len(values):
        return {f"{prefix}/{k}": float("nan") for k in ("mean", "max", "min")}
    return {
        f"{prefix}/mean": float(values.mean()),
        f"{prefix}/max": float(values.max()),
        f"{prefix}/min": float(values.min()),
    }


def rollout_metrics(scored: pd.DataFrame, advantages: pd.DataFrame, max_response_length: int) -> dict[str, float]:
    """Over the training samples only; ReMax's greedy baseline rows give remax/baseline_reward/mean."""
    scored, baselines = split_baseline_rows(scored)
    lengths = scored["response_length"].to_numpy()
    m = {
        **_stats("critic/score", scored["reward"]),
        **_stats("critic/rewards", scored["reward"]),
        **_stats("critic/advantages", advantages["advantage"]),
        **_stats("response_length", lengths),
        **_stats("prompt_length", scored["prompt_token_ids"].map(len)),
    }
    m["response_length/clip_ratio"] = float((scored["finish_reason"] == "length").mean())
    m["reward/flagged"] = float((~np.isfinite(scored["reward"].to_numpy(dtype=np.float64))).sum())  # on_error=flag
    masks = row_masks(scored.get("response_mask"))  # multi-turn: response_length counts observation tokens too
    if masks is not None:
        model_tokens = [int(n) if k is None else sum(k) for n, k in zip(lengths, masks, strict=True)]
        m["response_length/model_tokens_mean"] = float(np.mean(model_tokens))
    m |= multi_turn_metrics(scored)
    groups = scored.groupby("group_id")["reward"]
    m["critic/score/group_all_equal_frac"] = float((groups.nunique() == 1).mean())
    if len(baselines):
        m["remax/baseline_reward/mean"] = float(baselines["reward"].mean())
    return m | algorithm_metrics(scored, advantages)


def multi_turn_metrics(scored: pd.DataFrame) -> dict[str, float]:
    """Multi-turn rollouts (their `turns` column): num_turns/{mean,max,min} (verl's, assistant and tool turns),
    multi_turn/tool_call_rate (rollouts with a tool call), multi_turn/tool_calls/mean (observations per rollout),
    multi_turn/tool_error_rate (observations with an error). Nothing for single-turn rollouts."""
    if "turns" not in scored or not scored["turns"].map(lambda t: t is not None and len(t) > 0).any():
        return {}
    turns = [list(t) if t is not None else [] for t in scored["turns"]]
    tools = [[dict(x) for x in t if dict(x)["role"] == "tool"] for t in turns]
    observations = [x for t in tools for x in t]
    return {
        **_stats("num_turns", np.array([len(t) for t in turns])),
        "multi_turn/tool_call_rate": float(np.mean([len(t) > 0 for t in tools])),
        "multi_turn/tool_calls/mean": float(np.mean([len(t) for t in tools])),
        "multi_turn/tool_error_rate": float(np.mean([x["error"] is not None for x in observations]))
        if observations
        else 0.0,
    }


def algorithm_metrics(scored: pd.DataFrame, advantages: pd.DataFrame) -> dict[str, float]:
    """KL-in-reward (actor/reward_kl_penalty[_coeff], verl), DAPO dynamic sampling (train/num_gen_batches, verl;
    generated vs kept groups), overlong shaping and rollout-vs-actor probability gap (training/rollout_probs_*,
    verl) metrics, from the columns the stages stored."""
    m: dict[str, float] = {}
    if "kl_coef" in advantages and np.isfinite(advantages["kl_coef"].to_numpy(dtype=np.float64)).all():
        m["actor/reward_kl_penalty"] = float(advantages["reward_kl"].mean())
        m["actor/reward_kl_penalty_coeff"] = float(advantages["kl_coef"].iloc[0])
    if "gen_round" in scored:
        m["train/num_gen_batches"] = float(scored["gen_round"].nunique())
        m["train/num_groups_generated"] = float(scored["group_id"].nunique())
        m["train/num_groups_kept"] = float(advantages["group_id"].nunique())
    if "overlong_penalty" in scored:
        penalty = scored["overlong_penalty"].to_numpy(dtype=np.float64)
        m["reward/overlong_penalty/mean"] = float(penalty.mean())
        m["reward/overlong_penalized_frac"] = float((penalty < 0).mean())
    return m | model_reward_metrics(scored) | probs_diff_metrics(scored, advantages)


def model_reward_metrics(scored: pd.DataFrame) -> dict[str, float]:
    """With a reward model or a judge (their columns hold values): reward/rm_score/{mean,max,min},
    reward/judge_score/{mean,max,min} over the verdicts read, reward/judge_unparsed_frac, and the rule score
    they replace or add to, reward/rule_score/mean."""
    m: dict[str, float] = {}
    for column in ("rm_score", "judge_score"):
        values = scored[column].to_numpy(dtype=np.float64) if column in scored else np.zeros(0)
        if np.isfinite(values).any():
            m |= _stats(f"reward/{column}", values[np.isfinite(values)])
    if "judge_error" in scored and ("reward/judge_score/mean" in m or scored["judge_error"].notna().any()):
        m["reward/judge_unparsed_frac"] = float(scored["judge_error"].notna().mean())
    if m:
        m["reward/rule_score/mean"] = float(np.nanmean(scored["score"].to_numpy(dtype=np.float64)))
    return m


def probs_diff_metrics(scored: pd.DataFrame, advantages: pd.DataFrame) -> dict[str, float]:
    """verl's training/rollout_probs_diff_{valid,max,mean,std} and training/rollout_actor_probs_pearson_corr
    (stages.algos.probs_diff) over the training rollouts' response tokens: the actor's old_logprobs stored in
    the advantages table vs the engine's rollout_logprobs. Empty when the table holds no old log-probs."""
    if "old_logprobs" not in advantages or "rollout_logprobs" not in scored:
        return {}
    old = [[] if x is None else list(x) for x in advantages["old_logprobs"]]
    if [len(x) for x in old] != advantages["response_token_ids"].map(len).tolist():
        return {}  # an advantages table without them (written by an older rlake)
    engine = scored.set_index("rollout_id").loc[advantages["rollout_id"], "rollout_logprobs"].tolist()
    metrics, _, _ = probs_gap(old, engine, row_masks(advantages.get("response_mask")))  # model tokens only
    return metrics


def validation_metrics(scored: pd.DataFrame) -> dict[str, float]:
    """verl's validation metrics of scored validation rollouts (stages.algos.val_metrics): per data_source and
    variable, val-core/<ds>/<var>/<metric> and val-aux/<ds>/<var>/<metric>. The variables are verl's: `reward`
    and, for a scorer returning a dict, `score` and its extra keys (`acc`; `pred` turns on maj@K); a prompt's
    responses share its prompt_id."""
    extras = sorted({k for keys in scored.get("reward_extra_keys", []) for k in keys})
    infos = {"reward": scored["reward"].tolist()}
    if extras:  # verl's reward_extra_info holds every key of a dict return, "score" among them
        infos |= {k: scored[k].tolist() for k in ("score", *extras)}
    nested = process_validation_metrics(scored["data_source"].tolist(), scored["prompt_id"].tolist(), infos)
    return val_metric_names(nested)


def iteration_metrics(
    cfg: RunConfig,
    scored: pd.DataFrame,
    advantages: pd.DataFrame,
    *,
    update_metrics: dict[str, float],
    timings: dict[str, float],
    values: pd.DataFrame | None = None,
    critic_update_metrics: dict[str, float] | None = None,
) -> dict[str, float]:
    """The `iteration_metrics` stage: rollout and algorithm metrics, the policy update's metrics (returned by the
    update through Ray and recorded in the new checkpoint's `checkpoints` table row), the stages' timings and
    timing_s/step, and with a critic (values, critic_update_metrics) its metrics. Validation is added by the
    caller when validates(cfg, iteration)."""
    m = rollout_metrics(scored, advantages, cfg.data.max_response_length)
    m |= dict(update_metrics) | timings
    if values is not None and critic_update_metrics is not None:  # PPO with a critic: critic/vf_loss, ...
        m |= critic_metrics(advantages, values, critic_update_metrics)
    m["timing_s/step"] = sum(m.get(k, 0.0) for k in STEP_TIMINGS)
    return m


def validates(cfg: RunConfig, iteration: int) -> bool:
    """Whether iteration `iteration`'s new policy is validated: every trainer.test_freq-th one and the last."""
    last = iteration + 1 == cfg.trainer.total_training_steps
    return last or (cfg.trainer.test_freq > 0 and (iteration + 1) % cfg.trainer.test_freq == 0)
