"""Iteration metrics with verl's names (critic/score/mean, response_length/mean, ...).

The iteration_metrics stage streams its two partitions (streamed_rollout_metrics): per-row values stay (a few
numbers per rollout), token columns reduce batch by batch; rollout_metrics is the same computation on whole
frames."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import torch

from configs.schema import RunConfig
from stages.advantages import join
from stages.algos.critic_moments import CriticDataMoments
from stages.algos.probs_diff import PROBS_DIFF_KEYS
from stages.algos.val_metrics import process_validation_metrics, val_metric_names
from stages.dag import STEP_TIMINGS
from stages.filter_groups import split_baseline_rows
from stages.io.advantage_rows import JoinedAdvantages
from stages.io.stage_exec import Partition
from stages.train.batching import is_null, loss_mask, row_masks


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


SCORED_COLUMNS = (
    "group_id",
    "reward",
    "response_length",
    "prompt_token_ids",
    "finish_reason",
    "is_baseline",
    "response_mask",
    "turns",
    "gen_round",
    "overlong_penalty",
    "rm_score",
    "judge_score",
    "judge_error",
    "score",
)
"""The scored_rollouts columns rollout_metrics reads; the list columns among them are reduced per batch (row_counts)."""
LIST_COLUMNS = ("prompt_token_ids", "response_mask", "turns")

ADVANTAGE_SCALARS = ("group_id", "advantage", "kl_coef", "reward_kl", "teacher_kl")
PROBS_COLUMNS = ("old_logprobs", "rollout_logprobs", "response_token_ids", "response_mask")
"""The advantages columns rollout_metrics reads: per-row scalars, and the token columns of the probability gap."""


def row_counts(scored: pd.DataFrame) -> pd.DataFrame:
    """Scored rollouts with their list columns reduced to what the metrics count: prompt_token_ids to
    prompt_length, response_mask to model_tokens (+ has_mask), turns to num_turns / tool_calls / tool_errors;
    scalar columns as they are. Row-wise, so a partition's batches reduce one at a time."""
    out = scored[[c for c in SCORED_COLUMNS if c in scored and c not in LIST_COLUMNS]].copy()
    out["prompt_length"] = scored["prompt_token_ids"].map(len).to_numpy(dtype=np.int64)
    if "response_mask" in scored:
        masks = [None if is_null(m) else [int(v) for v in m] for m in scored["response_mask"]]
        lengths = scored["response_length"].to_numpy()
        out["model_tokens"] = [int(n) if k is None else sum(k) for n, k in zip(lengths, masks, strict=True)]
        out["has_mask"] = [k is not None for k in masks]
    if "turns" in scored:
        turns = [list(t) if t is not None else [] for t in scored["turns"]]
        tools = [[dict(x) for x in t if dict(x)["role"] == "tool"] for t in turns]
        out["num_turns"] = np.array([len(t) for t in turns], dtype=np.int64)
        out["tool_calls"] = np.array([len(t) for t in tools], dtype=np.int64)
        out["tool_errors"] = np.array([sum(x["error"] is not None for x in t) for t in tools], dtype=np.int64)
    return out


def rollout_metrics(scored: pd.DataFrame, advantages: pd.DataFrame, max_response_length: int) -> dict[str, float]:
    """Over the training samples only; ReMax's greedy baseline rows give remax/baseline_reward/mean. Whole frames
    (tests, callers holding them); the iteration_metrics stage streams its partitions (streamed_rollout_metrics)."""
    return rollout_row_metrics(row_counts(scored), advantages) | probs_diff_metrics(scored, advantages)


def rollout_row_metrics(rows: pd.DataFrame, advantages: pd.DataFrame) -> dict[str, float]:
    """rollout_metrics but the probability gap, from per-row values: row_counts of the scored rollouts and the
    advantages' ADVANTAGE_SCALARS."""
    rows, baselines = split_baseline_rows(rows)
    lengths = rows["response_length"].to_numpy()
    m = {
        **_stats("critic/score", rows["reward"]),
        **_stats("critic/rewards", rows["reward"]),
        **_stats("critic/advantages", advantages["advantage"]),
        **_stats("response_length", lengths),
        **_stats("prompt_length", rows["prompt_length"]),
    }
    m["response_length/clip_ratio"] = float((rows["finish_reason"] == "length").mean())
    m["reward/flagged"] = float((~np.isfinite(rows["reward"].to_numpy(dtype=np.float64))).sum())  # on_error=flag
    if "has_mask" in rows and rows["has_mask"].any():  # multi-turn: response_length counts observation tokens too
        m["response_length/model_tokens_mean"] = float(np.mean(rows["model_tokens"].to_numpy()))
    m |= multi_turn_metrics(rows)
    groups = rows.groupby("group_id")["reward"]
    m["critic/score/group_all_equal_frac"] = float((groups.nunique() == 1).mean())
    if len(baselines):
        m["remax/baseline_reward/mean"] = float(baselines["reward"].mean())
    return m | row_algorithm_metrics(rows, advantages)


def multi_turn_metrics(rows: pd.DataFrame) -> dict[str, float]:
    """Multi-turn rollouts (row_counts of their `turns` column): num_turns/{mean,max,min} (verl's, assistant and
    tool turns), multi_turn/tool_call_rate (rollouts with a tool call), multi_turn/tool_calls/mean (observations
    per rollout), multi_turn/tool_error_rate (observations with an error). Nothing for single-turn rollouts."""
    if "num_turns" not in rows or not (rows["num_turns"] > 0).any():
        return {}
    calls, observations = rows["tool_calls"].to_numpy(), int(rows["tool_calls"].sum())
    return {
        **_stats("num_turns", rows["num_turns"].to_numpy()),
        "multi_turn/tool_call_rate": float(np.mean(calls > 0)),
        "multi_turn/tool_calls/mean": float(np.mean(calls)),
        "multi_turn/tool_error_rate": float(rows["tool_errors"].sum() / observations) if observations else 0.0,
    }


def algorithm_metrics(scored: pd.DataFrame, advantages: pd.DataFrame) -> dict[str, float]:
    """KL-in-reward (actor/reward_kl_penalty[_coeff], verl), on-policy distillation's reverse KL to the teacher
    (actor/teacher_kl: the mean over rollouts of each one's token-mean log pi_student - log pi_teacher), DAPO
    dynamic sampling (train/num_gen_batches, verl; generated vs kept groups), overlong shaping and rollout-vs-actor
    probability gap (training/rollout_probs_*, verl) metrics, from the columns the stages stored."""
    return row_algorithm_metrics(scored, advantages) | probs_diff_metrics(scored, advantages)


def row_algorithm_metrics(scored: pd.DataFrame, advantages: pd.DataFrame) -> dict[str, float]:
    """algorithm_metrics but the probability gap: from per-row columns only."""
    m: dict[str, float] = {}
    if "kl_coef" in advantages and np.isfinite(advantages["kl_coef"].to_numpy(dtype=np.float64)).all():
        m["actor/reward_kl_penalty"] = float(advantages["reward_kl"].mean())
        m["actor/reward_kl_penalty_coeff"] = float(advantages["kl_coef"].iloc[0])
    teacher_kl = advantages["teacher_kl"].to_numpy(dtype=np.float64) if "teacher_kl" in advantages else np.zeros(0)
    if teacher_kl.size and np.isfinite(teacher_kl).all():  # on-policy distillation (algorithm.distillation)
        m["actor/teacher_kl"] = float(teacher_kl.mean())
    if "gen_round" in scored:
        m["train/num_gen_batches"] = float(scored["gen_round"].nunique())
        m["train/num_groups_generated"] = float(scored["group_id"].nunique())
        m["train/num_groups_kept"] = float(advantages["group_id"].nunique())
    if "overlong_penalty" in scored:
        penalty = scored["overlong_penalty"].to_numpy(dtype=np.float64)
        m["reward/overlong_penalty/mean"] = float(penalty.mean())
        m["reward/overlong_penalized_frac"] = float((penalty < 0).mean())
    return m | model_reward_metrics(scored)


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
    the advantages table vs the engine's rollout_logprobs (the advantages table keeps the scored row's, row by
    row). Empty when the tables hold no old or engine log-probs."""
    gap = ProbsGap("rollout_logprobs" in scored)
    gap.add(advantages)
    return gap.metrics()


class ProbsGap:
    """probs_diff_metrics over an advantages partition read batch by batch: each batch's counted tokens reduce to
    (count, max, means, centred sums of squares and products of the gap and of the two probabilities), merged
    pairwise (Chan et al.), so the mean, unbiased std and Pearson correlation are those of all tokens at once (to
    rounding); a partition whose tokens all lie in one batch gets probs_gap's numbers exactly (the same padded
    tensors and torch reductions as stages.algos.probs_diff.rollout_probs_diff)."""

    def __init__(self, engine: bool = True) -> None:
        self.usable = engine  # False: no engine log-probs, or an advantages table without them (an older rlake)
        self.stats: list[np.ndarray] = []  # per batch with counted tokens: n, max, mean_d, m2_d, mx, my, cxx, cyy, cxy
        self.first: dict[str, float] = {}  # the metrics of the first such batch
        self.seen = False  # a batch was added (with or without counted tokens)

    def add(self, advantages: pd.DataFrame) -> None:
        """Fold in a batch of advantages rows (PROBS_COLUMNS)."""
        if not self.usable or "old_logprobs" not in advantages or "rollout_logprobs" not in advantages:
            self.usable = False
            return
        old = [() if x is None else x for x in advantages["old_logprobs"]]
        if [len(x) for x in old] != advantages["response_token_ids"].map(len).tolist():
            self.usable = False  # an advantages table without them (written by an older rlake)
            return
        engine = [() if x is None else x for x in advantages["rollout_logprobs"]]
        x, y = counted_probs(old, engine, row_masks(advantages.get("response_mask")))  # model tokens only
        self.seen = True
        if not x.numel():
            return
        d = (x - y).abs()  # (K,) as rollout_probs_diff's diff[mask]
        mx, my, md = x.mean(), y.mean(), d.mean()
        if not self.stats:
            self.first = gap_metrics(x, y, d, md)
        sums = [((d - md) ** 2).sum(), ((x - mx) ** 2).sum(), ((y - my) ** 2).sum(), ((x - mx) * (y - my)).sum()]
        values = [x.numel(), d.max(), md, sums[0], mx, my, *sums[1:]]
        self.stats.append(np.array([float(v) for v in values], dtype=np.float64))

    def metrics(self) -> dict[str, float]:
        """The five metrics over every batch added ({} when unusable)."""
        if not self.usable or not self.seen:
            return {}
        if len(self.stats) <= 1:  # no counted token: valid 0, the rest NaN (verl)
            return self.first or dict(zip(PROBS_DIFF_KEYS, (0.0, *[float("nan")] * 4), strict=True))
        n, top, md, m2d, mx, my, cxx, cyy, cxy = reduce_stats(self.stats)
        std = float(np.sqrt(m2d / (n - 1)))
        pearson = float(cxy / np.sqrt(cxx * cyy)) if cxx * cyy > 0 else float("nan")
        return dict(zip(PROBS_DIFF_KEYS, (1.0, float(top), float(md), std, pearson), strict=True))


def gap_metrics(x: torch.Tensor, y: torch.Tensor, d: torch.Tensor, md: torch.Tensor) -> dict[str, float]:
    """rollout_probs_diff's five metrics of K >= 1 counted tokens (x, y: (K,) probabilities, d = |x - y|, md its
    mean), with its reductions; one token has a NaN std and correlation."""
    std = pearson = float("nan")
    if d.numel() > 1:
        std, pearson = d.std().item(), torch.corrcoef(torch.stack([x, y]))[0, 1].item()  # (2, K)
    return dict(zip(PROBS_DIFF_KEYS, (1.0, d.max().item(), md.item(), std, pearson), strict=True))


def counted_probs(old: list, engine: list, masks) -> tuple[torch.Tensor, torch.Tensor]:
    """((K,), (K,)) float64: exp(old_logprobs) and exp(rollout_logprobs) of the K tokens probs_gap counts, from
    the same (N, L) padded tensors (old, engine: N arrays or lists of log-probs)."""
    width = max(1, max((len(x) for x in engine), default=1))
    mask = loss_mask([len(x) for x in engine], width, masks).bool()  # (N, L)
    return _padded(old, width).double().exp()[mask], _padded(engine, width).double().exp()[mask]


def _padded(rows: list, width: int) -> torch.Tensor:
    """(N, width) float32 from N ragged rows, zeros after each row's end: ragged_to_padded's values, filled by
    numpy slices instead of one tensor per row."""
    out = np.zeros((len(rows), width), dtype=np.float32)
    for i, values in enumerate(rows):
        out[i, : len(values)] = values
    return torch.from_numpy(out)


def reduce_stats(stats: list[np.ndarray]) -> np.ndarray:
    """Merge per-batch (n, max, mean_d, m2_d, mean_x, mean_y, c_xx, c_yy, c_xy) into those of all the tokens."""
    n, top, md, m2d, mx, my, cxx, cyy, cxy = stats[0]
    for b in stats[1:]:
        nb, total = b[0], n + b[0]
        dd, dx, dy = b[2] - md, b[4] - mx, b[5] - my
        w = n * nb / total
        m2d, cxx = m2d + b[3] + dd * dd * w, cxx + b[6] + dx * dx * w
        cyy, cxy = cyy + b[7] + dy * dy * w, cxy + b[8] + dx * dy * w
        md, mx, my = md + dd * nb / total, mx + dx * nb / total, my + dy * nb / total
        n, top = total, max(top, b[1])
    return np.array([n, top, md, m2d, mx, my, cxx, cyy, cxy])


def streamed_rollout_metrics(
    scored: Partition, advantages: Partition | JoinedAdvantages, *, batch_rows: int | None = None
) -> dict:
    """rollout_metrics of two table partitions at their recorded versions, read batch by batch and only the columns
    it needs (stage_exec.iter_partition_batches): the list columns are reduced per batch (row_counts, ProbsGap), so
    what stays is a few numbers per row, never a token column of the partition."""
    rows, advantages = (
        [row_counts(b) for b in scored.batches(list(SCORED_COLUMNS), batch_rows)],
        JoinedAdvantages.of(advantages),
    )
    gap, adv = ProbsGap(), []  # scored_rollouts tables always hold rollout_logprobs (tables.ROLLOUT_FIELDS)
    for batch in advantages.batches([*ADVANTAGE_SCALARS, *PROBS_COLUMNS], batch_rows):
        adv.append(batch[[c for c in ADVANTAGE_SCALARS if c in batch]])
        gap.add(batch)
    m = rollout_row_metrics(pd.concat(rows, ignore_index=True), pd.concat(adv, ignore_index=True))
    return m | gap.metrics()


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


def counted_tokens(mask: pa.Array | None, lengths: np.ndarray) -> np.ndarray:
    """(T,) bool over a batch's flattened response tokens (T = lengths.sum()): a model token (response_mask 1, or a
    row without a mask); observation tokens (0) are not counted, as loss_mask leaves them out."""
    out = np.ones(int(lengths.sum()), dtype=bool)
    if mask is None or mask.null_count == len(mask):
        return out
    has = ~mask.is_null().to_numpy(zero_copy_only=False)
    in_masked_row = has[np.repeat(np.arange(len(lengths)), lengths)]
    flat = pc.list_flatten(mask).to_numpy(zero_copy_only=False)
    if len(flat) != int(in_masked_row.sum()):
        raise ValueError("advantages rows hold a response_mask of another length than their token_advantages")
    out[in_masked_row] = flat > 0
    return out


def streamed_critic_data_metrics(
    advantages: Partition, values: Partition, batch_rows: int | None = None
) -> dict[str, float]:
    """critic_data_metrics of the two partitions, streamed: the values joined to the advantages rows by rollout_id
    (stages.advantages.join: a merge join, record batch by record batch), the counted tokens of each batch
    merged into CriticDataMoments. Never a whole list column in memory."""
    ids, lengths = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for batch in advantages.record_batches(["rollout_id", "token_advantages"], batch_rows):
        ids.append(batch["rollout_id"].to_numpy())
        lengths.append(pc.list_value_length(batch["token_advantages"]).to_numpy(zero_copy_only=False))
    kept = pd.DataFrame({"rollout_id": np.concatenate(ids), "response_length": np.concatenate(lengths)})
    rows, moments, first = join(values, "values", kept, batch_rows).rows(), CriticDataMoments(), 0
    advantages = JoinedAdvantages.of(advantages)  # response_mask: the rollouts'
    columns = [c for c in ("returns", "token_advantages", "response_mask") if c in advantages.columns()]
    for batch in advantages.record_batches(columns, batch_rows):
        k = batch.num_rows
        if k:
            mask = batch["response_mask"] if "response_mask" in batch.schema.names else None
            counted = counted_tokens(mask, kept["response_length"].to_numpy()[first : first + k])
            flat = [
                pc.list_flatten(c).to_numpy(zero_copy_only=False)[counted]
                for c in (rows.take(first, k)["values"], batch["returns"], batch["token_advantages"])
            ]
            moments.add(*flat)
        first += k
    return moments.metrics()


def iteration_metrics(
    scored: Partition,
    advantages: Partition,
    *,
    update_metrics: dict[str, float],
    timings: dict[str, float],
    values: Partition | None = None,
    critic_update_metrics: dict[str, float] | None = None,
    batch_rows: int | None = None,
) -> dict[str, float]:
    """The `iteration_metrics` stage: rollout and algorithm metrics of the scored_rollouts and advantages partitions
    (streamed: streamed_rollout_metrics), the policy update's metrics (returned by the update through Ray and
    recorded in the new checkpoint's `checkpoints` table row), the stages' timings and timing_s/step, and with a
    critic (values, critic_update_metrics) its metrics. Validation is added by the caller when validates(cfg,
    iteration)."""
    advantages = JoinedAdvantages.of(advantages)  # the token and log-prob columns joined from their tables
    m = streamed_rollout_metrics(scored, advantages, batch_rows=batch_rows)
    m |= dict(update_metrics) | timings
    if values is not None and critic_update_metrics is not None:  # PPO with a critic: critic/vf_loss, ...
        m |= streamed_critic_data_metrics(advantages, values, batch_rows) | dict(critic_update_metrics)
    m["timing_s/step"] = sum(m.get(k, 0.0) for k in STEP_TIMINGS)
    return m


def validates(cfg: RunConfig, iteration: int) -> bool:
    """Whether iteration `iteration`'s new policy is validated: every trainer.test_freq-th one and the last."""
    last = iteration + 1 == cfg.trainer.total_training_steps
    return last or (cfg.trainer.test_freq > 0 and (iteration + 1) % cfg.trainer.test_freq == 0)
