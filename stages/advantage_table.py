"""Advantage stage: group statistics in one pass over the iteration's batch (no shuffle).

The outcome reward sits on each response's last token; `algorithm.adv_estimator` turns it into
token-level advantages (stages.algos.advantages.compute_advantages). The table keeps the
per-token values and, in `advantage`, the first token's (the per-rollout scalar for outcome
estimators such as GRPO and RLOO).

Multi-turn rollouts carry a `response_mask` (1 = model token, 0 = observation token, null = all ones): the
estimators see the mask (padding and observation tokens are 0), so the outcome reward sits on the last model
token, GAE bootstraps across observation tokens to the next model token, and the advantages (and returns) of
observation tokens are 0. The table keeps the mask for the update. The per-token lists (old_logprobs,
ref_logprobs, values) still hold one entry per response token, observation tokens included.

ReMax's greedy rows (`is_baseline` in scored_rollouts) are never training samples: every estimator
drops them, and remax takes each group's baseline reward from its one greedy row (missing: an error).

KL in the reward (algorithm.use_kl_in_reward) compares the actor's recomputed old log-probs (the
old_logprobs table, verl's old_log_prob) with the reference's, as verl's apply_kl_penalty does. The table
carries each rollout's old_logprobs (the torch update's PPO ratio denominator) and its engine-vs-trainer gap
(rollout_probs_diff_max / _mean), so a query finds the rollouts where the engine and the trainer disagree,
and the engine's rollout_logprobs, which the update's algorithm.rollout_correction compares with the trainer's.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from configs.schema import AlgorithmConfig, DistillationConfig, RunConfig
from stages.algos.advantages import compute_advantages, outcome_to_token_rewards
from stages.algos.distill import compute_distillation_advantages, teacher_kl_per_rollout
from stages.algos.kl import apply_kl_penalty, compute_kl_penalty
from stages.algos.kl_ctrl import make_kl_controller
from stages.filter_groups import select_training_groups, split_baseline_rows
from stages.train.batching import loss_mask, ragged_to_padded, row_masks


def drop_flagged_rollouts(scored: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """(rows with a finite reward, how many were dropped): reward.on_error='flag' trains on the
    rest of the batch; the flagged rows stay in scored_rollouts with their reward_error. A group whose
    ReMax baseline row is flagged has no baseline: all its rows are dropped."""
    ok = np.isfinite(scored["reward"].to_numpy(dtype=np.float64))
    if "is_baseline" in scored:
        lost = set(scored.loc[~ok & scored["is_baseline"].astype(bool).to_numpy(), "group_id"])
        ok &= ~scored["group_id"].isin(lost).to_numpy()
    if len(scored) and not ok.any():
        raise ValueError(
            f"all {len(scored)} rollouts were flagged by the reward stage (reward_error in "
            "scored_rollouts), so there is nothing to train on; fix the reward function and "
            "re-materialize scored_rollouts for this iteration"
        )
    return scored[ok].reset_index(drop=True), int((~ok).sum())


def remax_baseline_rewards(sampled: pd.DataFrame, baselines: pd.DataFrame) -> torch.Tensor:
    """(N,) the reward of each sampled rollout's group's greedy baseline row (exactly one per group)."""
    counts = baselines["group_id"].value_counts()
    twice = counts[counts > 1].index.tolist()[:10]
    missing = sorted(set(sampled["group_id"]) - set(baselines["group_id"]))[:10]
    bad = baselines.loc[~np.isfinite(baselines["reward"].to_numpy(dtype=np.float64)), "group_id"].tolist()[:10]
    if missing or twice or bad:
        found = "; ".join(
            f"groups {g} {what}"
            for g, what in ((missing, "have none"), (twice, "have several"), (bad, "have a non-finite baseline reward"))
            if g
        )
        raise ValueError(
            f"adv_estimator='remax' needs exactly one greedy baseline row (is_baseline) with a finite reward per "
            f"group, because each sample's advantage is its reward minus its prompt's greedy reward; {found}. "
            "Re-materialize rollouts and scored_rollouts of this iteration with adv_estimator='remax' (rollouts "
            "made by another estimator have no baselines), fix the reward function, or pick another adv_estimator"
        )
    by_group = dict(zip(baselines["group_id"].tolist(), baselines["reward"].tolist(), strict=True))
    return torch.tensor([by_group[g] for g in sampled["group_id"].tolist()], dtype=torch.float32)


def compute_advantage_table(
    scored: pd.DataFrame,
    algorithm_cfg: AlgorithmConfig,
    values: pd.DataFrame | None = None,
    *,
    ref: pd.DataFrame | None = None,
    kl_coef: float | None = None,
    old: pd.DataFrame | None = None,
    teacher: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """Rows of the advantages table for one iteration's scored rollouts (`values`: its values table, needed by
    adv_estimator='gae'; `ref`, `old`, `teacher`: its ref_logprobs, old_logprobs and teacher_logprobs tables).
    ReMax's greedy baseline rows are left out of the table (and give remax its per-group baseline)."""
    scored, baselines = split_baseline_rows(scored)
    baseline_rewards = remax_baseline_rewards(scored, baselines) if algorithm_cfg.adv_estimator == "remax" else None
    rewards = finite_rewards(scored)
    lengths = torch.tensor(scored["response_length"].to_numpy(dtype=np.int64))
    mask, masks = model_token_mask(scored, lengths)  # (N, L) 1 on the model's tokens: the reward sits on the last
    token_rewards = outcome_to_token_rewards(torch.tensor(rewards, dtype=torch.float32), mask)  # (N, L)
    old_lp, old_cols = old_logprob_columns(scored, old, lengths, mask.shape[1])  # (N, L) or None, the table's
    # KL in reward (ref: the ref_logprobs table): token_rewards -= beta * KL per token, before any estimator
    token_rewards, kl_cols = reward_kl_columns(scored, ref, token_rewards, mask, algorithm_cfg, kl_coef, old_lp)
    gae_values = critic_values(scored, values, mask.shape[1]) if algorithm_cfg.adv_estimator == "gae" else None
    adv, returns = estimate(algorithm_cfg, token_rewards, mask, scored["group_id"], gae_values, baseline_rewards)
    adv, distill_cols = distillation_columns(scored, teacher, adv, mask, old_lp, algorithm_cfg.distillation)
    keys = ("rollout_id", "group_id", "policy_version", "prompt_token_ids", "response_token_ids")
    return pd.DataFrame(
        {
            **{key: scored[key].to_numpy() for key in keys},
            "response_mask": pd.Series(masks or [None] * len(scored), dtype=object),
            "reward": rewards,
            "advantage": adv[:, 0].numpy(),
            "token_advantages": [adv[i, :n].tolist() for i, n in enumerate(lengths.tolist())],
            "adv_estimator": algorithm_cfg.adv_estimator,
            "rollout_logprobs": engine_logprob_lists(scored),
            **old_cols,
            **kl_cols,
            **distill_cols,
            "returns": [returns[i, :n].tolist() for i, n in enumerate(lengths.tolist())],
        }
    )


def estimate(algorithm_cfg: AlgorithmConfig, token_rewards, mask, group_ids, values=None, baseline_rewards=None):
    """(advantages, returns), each (N, L): algorithm.adv_estimator over token_rewards and mask (N, L), with the
    algorithm's lam / gamma / norm_adv_by_std_in_grpo; group_ids (N,) the rows' group_id column; values (N, L)
    for gae, baseline_rewards (N,) for remax."""
    return compute_advantages(
        algorithm_cfg.adv_estimator,
        token_level_rewards=token_rewards,
        response_mask=mask,
        values=values,
        lam=algorithm_cfg.lam,
        group_ids=torch.tensor(np.asarray(group_ids, dtype=np.int64)),
        baseline_rewards=baseline_rewards,
        gamma=algorithm_cfg.gamma,
        norm_adv_by_std_in_grpo=algorithm_cfg.norm_adv_by_std_in_grpo,
    )


def model_token_mask(scored: pd.DataFrame, lengths: torch.Tensor) -> tuple[torch.Tensor, list | None]:
    """((N, L) float mask, 1 on the model's tokens of each response: 0 on padding and, where the rollout has a
    response_mask, on its observation tokens; the rows' response masks (stages.train.batching.row_masks), None
    when no rollout has one). lengths: (N,) response tokens per rollout; L = max(1, the longest)."""
    masks = row_masks(scored.get("response_mask"))
    return loss_mask(lengths.tolist(), max(1, int(lengths.max())), masks), masks


def engine_logprob_lists(scored: pd.DataFrame) -> list[list[float]]:
    """The rollouts' engine log-probs (rollout_logprobs, one per response token) for the update's
    algorithm.rollout_correction; empty lists where the scored rows have none (tests, older tables)."""
    if "rollout_logprobs" not in scored:
        return [[] for _ in range(len(scored))]
    return [[] if x is None else list(x) for x in scored["rollout_logprobs"]]


def finite_rewards(scored: pd.DataFrame) -> np.ndarray:
    """(N,) float64 rewards of the scored rollouts; a non-finite one is an error naming its rollouts."""
    rewards = scored["reward"].to_numpy(dtype=np.float64)
    if not np.isfinite(rewards).all():
        bad = scored.loc[~np.isfinite(rewards), "rollout_id"].tolist()[:10]
        raise ValueError(
            f"non-finite rewards for rollouts {bad} (see reward_error in scored_rollouts); "
            "fix the reward function or re-score before computing advantages"
        )
    return rewards


def critic_values(scored: pd.DataFrame, values: pd.DataFrame | None, width: int) -> torch.Tensor:
    """(N, width) critic values aligned to `scored` by rollout_id (GAE), zeros after each response."""
    if values is None:
        raise ValueError(
            "adv_estimator='gae' needs the iteration's critic values (the `values` table); "
            "materialize the `values` asset of this iteration first, or pick another estimator"
        )
    by_id = dict(zip(values["rollout_id"].tolist(), values["values"], strict=True))
    missing = [r for r in scored["rollout_id"].tolist() if r not in by_id][:10]
    if missing:
        raise ValueError(
            f"rollouts {missing} have no critic values; the values table is from other rollouts: "
            "re-materialize `values` of this iteration after its rollouts"
        )
    out = torch.zeros(len(scored), width)
    for i, (rid, n) in enumerate(zip(scored["rollout_id"].tolist(), scored["response_length"].tolist(), strict=True)):
        v = list(by_id[rid])
        if len(v) != n:
            raise ValueError(f"rollout {rid}: {len(v)} critic values for {n} response tokens; re-materialize `values`")
        out[i, :n] = torch.as_tensor(v, dtype=torch.float32)
    return out


def old_logprob_columns(
    scored: pd.DataFrame, old: pd.DataFrame | None, lengths: torch.Tensor, width: int
) -> tuple[torch.Tensor | None, dict]:
    """((N, L) the old_logprobs table's log-probs aligned to `scored` by rollout_id, or None without the table;
    the advantages table's old_logprobs / rollout_probs_diff_max / rollout_probs_diff_mean columns, copied from
    it: empty lists and NaN without it).

    old: rollout_id, old_logprobs (one float per response token, observation tokens too),
    rollout_probs_diff_max / _mean. lengths: (N,) response tokens of each scored rollout; width: L."""
    n = len(scored)
    cols = {
        "old_logprobs": [[] for _ in range(n)],
        "rollout_probs_diff_max": np.full(n, np.nan),
        "rollout_probs_diff_mean": np.full(n, np.nan),
    }
    if old is None:
        return None, cols
    rows = old.set_index("rollout_id")
    ids = scored["rollout_id"].tolist()
    missing = [r for r in ids if r not in rows.index][:10]
    if missing:
        raise ValueError(
            f"rollouts {missing} have no old log-probs; the old_logprobs table is from other rollouts: "
            "re-materialize old_logprobs of this iteration after its rollouts"
        )
    rows = rows.loc[ids]
    lists = [list(x) for x in rows["old_logprobs"]]
    bad = [r for r, x, k in zip(ids, lists, lengths.tolist(), strict=True) if len(x) != k][:10]
    if bad:
        raise ValueError(f"rollouts {bad}: old_logprobs of another length than the response; re-materialize them")
    cols["old_logprobs"] = lists
    for column in ("rollout_probs_diff_max", "rollout_probs_diff_mean"):
        cols[column] = rows[column].to_numpy(dtype=np.float64)
    return ragged_to_padded(lists, width), cols


def reward_kl_columns(
    scored: pd.DataFrame,
    ref: pd.DataFrame | None,
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    algorithm_cfg: AlgorithmConfig,
    kl_coef: float | None,
    old_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """(token-level rewards, the ref_logprobs / kl_coef / reward_kl columns of the advantages table).

    With ref (rollout_id + ref_logprobs lists) the rows carry their reference log-probs (for actor.use_kl_loss);
    with algorithm.use_kl_in_reward also r_t -= kl_coef * KL_t(old_logprobs, ref_logprobs) (verl
    apply_kl_penalty, on the actor's recomputed old log-probs (N, L)) and reward_kl = the rollout's token-mean
    KL, which the adaptive controller reads back. old_logprobs None (no old_logprobs table: unit tests, tables
    of an older rlake): the engine's rollout_logprobs instead."""
    n = len(scored)
    cols = {"ref_logprobs": [[] for _ in range(n)], "kl_coef": np.full(n, np.nan), "reward_kl": np.full(n, np.nan)}
    if ref is None:
        if algorithm_cfg.use_kl_in_reward:
            raise ValueError(
                "algorithm.use_kl_in_reward=True needs the iteration's ref_logprobs table; materialize "
                "the ref_logprobs asset of this iteration first, or set use_kl_in_reward=false"
            )
        return token_rewards, cols
    by_id = dict(zip(ref["rollout_id"].tolist(), ref["ref_logprobs"], strict=True))
    missing = [r for r in scored["rollout_id"].tolist() if r not in by_id][:10]
    if missing:
        raise ValueError(
            f"rollouts {missing} have no reference log-probs; the ref_logprobs table is from other "
            "rollouts: re-materialize ref_logprobs of this iteration after its rollouts"
        )
    ref_lists = [list(by_id[rid]) for rid in scored["rollout_id"].tolist()]
    lengths = scored["response_length"].astype(int).tolist()  # every response token, observations too
    assert [len(r) for r in ref_lists] == lengths, f"{[len(r) for r in ref_lists]=} {lengths=}"
    cols["ref_logprobs"] = ref_lists
    if not algorithm_cfg.use_kl_in_reward:
        return token_rewards, cols
    ref_lp = ragged_to_padded(ref_lists, mask.shape[1])  # (N, L)
    lp = old_logprobs if old_logprobs is not None else ragged_to_padded(scored["rollout_logprobs"], mask.shape[1])
    rewards, kl_cols = kl_in_reward(algorithm_cfg, token_rewards, mask, lp, ref_lp, kl_coef)
    return rewards, cols | kl_cols


def kl_in_reward(
    algorithm_cfg: AlgorithmConfig, token_rewards, mask, student, ref_lp, kl_coef: float | None
) -> tuple[torch.Tensor, dict]:
    """verl's apply_kl_penalty on dense tensors: (token rewards (N, L) less beta * KL_t(student, ref_lp), the
    kl_coef / reward_kl (N,) columns: beta and each rollout's token-mean KL). token_rewards, mask, student (the
    actor's log-probs), ref_lp: (N, L); kl_coef None: algorithm.kl_ctrl.kl_coef."""
    beta = algorithm_cfg.kl_ctrl.kl_coef if kl_coef is None else kl_coef
    rewards, _ = apply_kl_penalty(token_rewards, student, ref_lp, mask, beta, algorithm_cfg.kl_penalty)
    kld = compute_kl_penalty(student, ref_lp, algorithm_cfg.kl_penalty) * mask  # (N, L)
    reward_kl = (kld.sum(-1) / mask.sum(-1).clamp(min=1)).double().numpy()  # (N,) token-mean per rollout
    return rewards, {"kl_coef": np.full(len(mask), beta), "reward_kl": reward_kl}


def distillation_columns(
    scored: pd.DataFrame,
    teacher: pd.DataFrame | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    distill_cfg: DistillationConfig,
) -> tuple[torch.Tensor, dict]:
    """(advantages, the teacher_logprobs / teacher_kl columns of the advantages table): with
    algorithm.distillation.enable, adv (N, L) becomes stages.algos.distill.compute_distillation_advantages of it, the
    student's old log-probs (N, L) (None: the engine's rollout_logprobs) and the teacher's (the teacher_logprobs
    table: rollout_id + teacher_logprobs lists); teacher_kl is each rollout's token-mean log pi_student - log
    pi_teacher over its own tokens. Without distillation: adv unchanged, empty lists and NaN."""
    n = len(scored)
    cols = {"teacher_logprobs": [[] for _ in range(n)], "teacher_kl": np.full(n, np.nan)}
    if not distill_cfg.enable:
        return adv, cols
    if teacher is None:
        raise ValueError(
            "algorithm.distillation.enable=true needs the iteration's teacher_logprobs table, because the "
            "distillation advantage compares the student's log-probs with the teacher's; materialize the "
            "teacher_logprobs asset of this iteration first, or set algorithm.distillation.enable=false"
        )
    by_id = dict(zip(teacher["rollout_id"].tolist(), teacher["teacher_logprobs"], strict=True))
    ids = scored["rollout_id"].tolist()
    lists = [list(by_id.get(rid, ())) for rid in ids]
    bad = [r for r, x, k in zip(ids, lists, scored["response_length"].astype(int), strict=True) if len(x) != k]
    if bad:
        raise ValueError(
            f"rollouts {bad[:10]} have no teacher log-probs of their response's length; the teacher_logprobs table "
            "is from other rollouts: re-materialize teacher_logprobs of this iteration after its rollouts"
        )
    student = old_logprobs if old_logprobs is not None else ragged_to_padded(scored["rollout_logprobs"], mask.shape[1])
    adv, cols["teacher_kl"] = distilled(adv, student, ragged_to_padded(lists, mask.shape[1]), mask, distill_cfg)
    cols["teacher_logprobs"] = lists
    return adv, cols


def distilled(adv, student, teacher_lp, mask, distill_cfg: DistillationConfig) -> tuple[torch.Tensor, np.ndarray]:
    """(compute_distillation_advantages of adv with algorithm.distillation's knobs, each rollout's token-mean
    reverse KL (N,) float64). adv, student, teacher_lp, mask: (N, L)."""
    adv, reverse_kl = compute_distillation_advantages(
        adv,
        student,
        teacher_lp,
        mask,
        kl_penalty_coef=distill_cfg.kl_penalty_coef,
        use_task_rewards=distill_cfg.use_task_rewards,
        loss_max_clamp=distill_cfg.loss_max_clamp,
    )
    return adv, teacher_kl_per_rollout(reverse_kl, mask).double().numpy()


def kl_coef_for_iteration(algorithm_cfg: AlgorithmConfig, previous: pd.DataFrame | None) -> float:
    """beta of this iteration: kl_ctrl.kl_coef (fixed, or iteration 0), else the adaptive controller's update
    of the previous iteration's stored beta by its stored per-rollout KL (a function of stored data only,
    so re-materializing or resuming an iteration reproduces it).

    previous: the previous iteration's advantages partition (kl_coef, reward_kl), None at iteration 0."""
    ctrl = algorithm_cfg.kl_ctrl
    if ctrl.type == "fixed" or previous is None:
        return float(ctrl.kl_coef)
    beta = float(previous["kl_coef"].iloc[0])
    kl = previous["reward_kl"].to_numpy(dtype=np.float64)
    if not np.isfinite(beta) or not np.isfinite(kl).all():
        raise ValueError(
            "the previous iteration's advantages hold no KL-in-reward coefficient (it ran without "
            "algorithm.use_kl_in_reward); re-materialize it with this config or use kl_ctrl.type=fixed"
        )
    controller = make_kl_controller("adaptive", kl_coef=beta, target_kl=ctrl.target_kl, horizon=ctrl.horizon)
    controller.update(float(kl.mean()), n_steps=len(previous))
    return float(controller.value)


def uses_adaptive_kl(cfg: RunConfig) -> bool:
    """KL in the reward with the adaptive controller: beta of iteration N follows from iteration N-1's table."""
    return bool(cfg.algorithm.use_kl_in_reward and cfg.algorithm.kl_ctrl.type == "adaptive")


def iteration_advantages(
    cfg: RunConfig,
    scored: pd.DataFrame,
    *,
    values: pd.DataFrame | None = None,
    ref: pd.DataFrame | None = None,
    previous: pd.DataFrame | None = None,
    old: pd.DataFrame | None = None,
    teacher: pd.DataFrame | None = None,
) -> tuple[pd.DataFrame, int]:
    """The `advantages` stage: (the iteration's advantages table, rollouts dropped as flagged).

    Rollouts the reward stage flagged (reward.on_error='flag') are dropped, DAPO's group filter keeps the
    first train_batch_size groups with reward spread (algorithm.filter_groups), then algorithm.adv_estimator
    runs. values: the iteration's `values` (GAE); ref: its `ref_logprobs` (KL in the reward); previous: the
    previous iteration's advantages (the adaptive KL controller's state); old: its `old_logprobs` (the actor's
    log-probs: KL in the reward, the update's ratio denominator, the engine-vs-trainer gap columns); teacher: its
    `teacher_logprobs` (on-policy distillation, algorithm.distillation)."""
    dropped = 0
    if cfg.reward.on_error == "flag":
        scored, dropped = drop_flagged_rollouts(scored)
    kept = select_training_groups(
        scored, cfg.algorithm.filter_groups, need_groups=cfg.data.train_batch_size, correct_score=cfg.reward.score
    )
    kl_coef = kl_coef_for_iteration(cfg.algorithm, previous) if cfg.algorithm.use_kl_in_reward else None
    kw = {"values": values, "ref": ref, "kl_coef": kl_coef, "old": old, "teacher": teacher}
    return compute_advantage_table(kept, cfg.algorithm, **kw), dropped
