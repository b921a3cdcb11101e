"""The advantages stage streamed (#36): no whole table as pandas in the Dagster step.

stages.advantage_table.compute_advantage_table turns whole frames (every token list a Python object: ~8 GB of driver at
100k rollouts of ~256 tokens) into the table. Here, for the same rows, order and values:

1. scalars: rollout_id, group_id, policy_version, reward, response_length, is_baseline, score of scored_rollouts,
   streamed; today's row selection (drop_flagged_rollouts, select_training_groups, split_baseline_rows) on them.
2. numbers: grpo (Dr.GRPO), rloo and opo without KL in the reward or distillation (per_row_path, the common case)
   need per-row scalars only: the outcome score and the model-token count per row, then the same estimator
   functions, and each output batch's token rows are those scalars times the batch's mask. Every other
   estimator/option (REINFORCE++ and GAE whiten or run over the whole batch; KL in the reward, distillation, remax)
   fills the (N, L) float32 tensors compute_advantage_table builds (mask; old/ref/teacher log-probs, values) batch
   by batch and runs the same functions on them whole. Either way the numbers are bit-identical to today's.
   The joined tables (old_logprobs, ref_logprobs, values, teacher_logprobs) are joined by rollout_id with a
   merge join (join, JoinedRows): a first streamed pass reads their rollout_id and list lengths only (the checks),
   then each pass that needs their token lists streams them a record batch at a time alongside scored_rollouts.
   That needs them in the kept order (their stages write them in the rollouts' order); a table out of that order
   is read whole as Arrow and taken into the kept order (the step's peak then grows by about 2x its column).
3. output: the kept rows' response masks streamed again (Arrow), each batch's rows with their slices of the
   outputs, one Parquet file per batch, ONE Delta commit (stage_exec.write_frames). The list columns reach the
   writer as Arrow buffers (token_advantages and returns built from numpy), never as Python lists. The table
   holds what this stage computes; the rows' token columns and old/ref/teacher log-probs stay in their tables,
   which its readers join by rollout_id (stages/io/advantage_rows.py; the commit records `joins`).

Whole-frame fallback, explicit: when the kept order is not the scored partition's stream order (DAPO's filter
sorts by rollout_id, a partition Ray Data wrote out of that order), one streamed pass cannot write today's row
order, so the partitions are read whole and stages.advantage_table.iteration_advantages computes the table, as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import torch

from configs.schema import RunConfig
from stages.advantage_table import (
    distilled,
    drop_flagged_rollouts,
    estimate,
    finite_rewards,
    iteration_advantages,
    kl_coef_for_iteration,
    kl_in_reward,
    remax_baseline_rewards,
)
from stages.algos.advantages import (
    broadcast_to_tokens,
    compute_grpo_advantages,
    compute_opo_advantages,
    compute_rloo_advantages,
    outcome_to_token_rewards,
)
from stages.filter_groups import select_training_groups, split_baseline_rows
from stages.io.advantage_rows import JOINED, with_joins
from stages.io.stage_exec import BATCH_ROWS, MergeTake, Partition, stream_places, write_frames
from stages.train.batching import loss_mask, row_masks

SCALARS = ["rollout_id", "group_id", "policy_version", "reward", "response_length", "is_baseline", "score"]
"""The scored_rollouts columns the row selection and the outcome math read (pass 1)."""

MASK = ["rollout_id", "response_mask"]
"""What pass 3 reads of scored_rollouts (response_mask: when the rollouts have it): the rows' token advantages."""

SUMMARY = ["group_id", "advantage", "kl_coef", "teacher_kl"]
"""The per-row columns the asset's metadata and finite check read (returned, never read back)."""

JOINS = {
    "old": ("old_logprobs", "old log-probs", "old_logprobs"),
    "ref": ("ref_logprobs", "reference log-probs", "ref_logprobs"),
    "values": ("values", "critic values", "values"),
    "teacher": ("teacher_logprobs", "teacher log-probs", "teacher_logprobs"),
}
"""Upstream table -> (its token column, what its rows are, the asset to re-materialize)."""


@dataclass(frozen=True)
class Upstream:
    """The partitions the advantages stage reads (None: the run does not use that table)."""

    scored: Partition
    old: Partition | None = None
    ref: Partition | None = None
    values: Partition | None = None
    teacher: Partition | None = None
    previous: Partition | None = None


@dataclass(frozen=True)
class AdvantageRun:
    """What one streamed advantages stage did: new version, SUMMARY columns, rollouts dropped as flagged, mode."""

    version: int
    summary: pd.DataFrame
    dropped: int
    mode: str


def read_scalars(scored: Partition, batch_rows: int | None = None) -> pd.DataFrame:
    """Pass 1: the SCALARS columns scored_rollouts has, plus `_pos` (the row's place in the stream)."""
    frame = pd.concat(list(scored.batches(SCALARS, batch_rows)), ignore_index=True)
    return frame.assign(_pos=np.arange(len(frame)))


def selected_rows(cfg: RunConfig, scalars: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, int]:
    """(kept training rows in the table's order, ReMax baseline rows, rollouts dropped as flagged): the row
    selection of stages.advantage_table.iteration_advantages, on the scalar columns."""
    dropped = 0
    if cfg.reward.on_error == "flag":
        scalars, dropped = drop_flagged_rollouts(scalars)
    kept = select_training_groups(
        scalars, cfg.algorithm.filter_groups, need_groups=cfg.data.train_batch_size, correct_score=cfg.reward.score
    )
    kept, baselines = split_baseline_rows(kept)
    return kept, baselines, dropped


@dataclass(frozen=True)
class Joined:
    """An upstream table joined by rollout_id: `positions`, the place in its stream of each kept row's row (in the
    kept order); `whole`, its columns taken into the kept order, only where those places do not increase."""

    part: Partition
    which: str
    positions: np.ndarray
    whole: pa.Table | None
    batch_rows: int | None = None

    def rows(self) -> JoinedRows:
        """A new pass over the kept rows' rows."""
        return JoinedRows(self)


def join(part: Partition, which: str, kept: pd.DataFrame, batch_rows: int | None = None) -> Joined:
    """The upstream table's rows of the kept rollouts (streamed: rollout_id and list lengths only); a kept rollout
    it lacks, or a token list of another length than the response, is an error naming the rollouts."""
    column, what, asset = JOINS[which]
    ids, lengths = [np.zeros(0, np.int64)], [np.zeros(0)]
    for batch in part.record_batches(["rollout_id", column]):
        ids.append(batch["rollout_id"].to_numpy())
        lengths.append(pc.list_value_length(batch[column]).to_numpy(zero_copy_only=False))
    src, wanted = np.concatenate(ids), kept["rollout_id"].to_numpy()
    positions, found = stream_places(src, wanted)
    if not found.all():
        raise ValueError(
            f"rollouts {wanted[~found][:10].tolist()} have no {what}; the {asset} table is from other rollouts: "
            f"re-materialize {asset} of this iteration after its rollouts"
        )
    bad = wanted[np.concatenate(lengths)[positions] != kept["response_length"].to_numpy(dtype=np.int64)]
    if len(bad):
        raise ValueError(
            f"rollouts {bad[:10].tolist()}: {what} of another length than the response; re-materialize {asset}"
        )
    ordered = bool((np.diff(positions) > 0).all())  # the table in the kept order (a subset): merge, else take whole
    whole = None if ordered else part.arrow([column]).take(pa.array(positions))
    return Joined(part, which, positions, whole, batch_rows)


class JoinedRows(MergeTake):
    """One pass over a Joined table's kept rows (stage_exec.MergeTake over its token column): take(first,
    k), called with increasing `first`, gives kept rows first..first+k. A merge join over the two streams, or the
    `whole` columns sliced."""

    def __init__(self, joined: Joined):
        super().__init__(joined.part, [JOINS[joined.which][0]], joined.positions, joined.batch_rows, whole=joined.whole)


def fill_rows(out: torch.Tensor, column: pa.Array | pa.ChunkedArray) -> None:
    """Write a list column's k rows into `out` (k, width) (zeros after each list, a null row all zeros), as
    ragged_to_padded does from Python lists."""
    lengths = pc.list_value_length(column).fill_null(0).to_numpy()
    within = np.arange(out.shape[1])[None, :] < lengths[:, None]  # (k, width)
    out.numpy()[within] = pc.list_flatten(column).to_numpy(zero_copy_only=False)


def padded(joined: Joined, width: int) -> torch.Tensor:
    """(N, width) float32 of a joined table's token column in the kept order, a batch at a time."""
    column, rows, n = JOINS[joined.which][0], joined.rows(), len(joined.positions)
    out = torch.zeros(n, width)
    for first in range(0, n, BATCH_ROWS):
        fill_rows(out[first : first + BATCH_ROWS], rows.take(first, min(BATCH_ROWS, n - first))[column])
    return out


def kept_batches(scored: Partition, kept: pd.DataFrame, columns: list[str], batch_rows: int | None):
    """(first kept index, the batch's kept rows as Arrow) over scored_rollouts streamed again, in the kept order
    (which is the stream's: stream_advantages checked it)."""
    pos, seen, first = kept["_pos"].to_numpy(), 0, 0
    for batch in scored.record_batches(columns, batch_rows):
        stop = int(np.searchsorted(pos, seen + batch.num_rows))
        if stop > first:
            yield first, batch.take(pa.array(pos[first:stop] - seen))
        seen, first = seen + batch.num_rows, stop


def masks_of(rows: pa.RecordBatch):
    """row_masks of the rows' response_mask (None: the table has none, or no row has one)."""
    return row_masks(rows["response_mask"].to_pylist() if "response_mask" in rows.schema.names else None)


def scored_dense(scored: Partition, kept: pd.DataFrame, width: int, engine_lp: bool, batch_rows: int | None):
    """((N, width) model-token mask, (N, width) engine rollout_logprobs or None): the mask as
    stages.advantage_table.model_token_mask makes it, filled a batch at a time."""
    lengths = kept["response_length"].to_numpy(dtype=np.int64)
    mask = loss_mask(lengths.tolist(), width)  # (N, L) all ones up to each length
    has = set(scored.columns())
    columns = [c for c in ("response_mask", "rollout_logprobs") if c in has and (c == "response_mask" or engine_lp)]
    lp = torch.zeros(len(kept), width) if engine_lp else None
    if not columns:
        return mask, lp
    for first, rows in kept_batches(scored, kept, columns, batch_rows):
        stop = first + rows.num_rows
        masks = masks_of(rows)
        if masks is not None:
            mask[first:stop] = loss_mask(lengths[first:stop].tolist(), width, masks)
        if engine_lp:
            fill_rows(lp[first:stop], rows["rollout_logprobs"])
    return mask, lp


@dataclass(frozen=True)
class Outputs:
    """The stage's numbers: advantages (N, L) and returns (N, L), or per-row advantages (N,) whose token rows are
    them times the model-token mask (returns = advantages, per_row_path); rewards (N,); kl_coef / reward_kl /
    teacher_kl (N,) columns."""

    adv: torch.Tensor
    returns: torch.Tensor | None
    rewards: np.ndarray
    cols: dict

    def token_rows(self, first: int, lengths: np.ndarray, masks) -> tuple[torch.Tensor, torch.Tensor]:
        """(advantages, returns) of kept rows first..first+len(lengths), (k, L') with L' >= each length."""
        sl = slice(first, first + len(lengths))
        if self.returns is not None:
            return self.adv[sl], self.returns[sl]
        mask = loss_mask(lengths.tolist(), max(1, int(lengths.max())), masks)  # (k, L') the rows' own width
        tokens = broadcast_to_tokens(self.adv[sl], mask)  # (k, L') as compute_advantages' _grpo / _rloo / _opo
        return tokens, tokens


PER_ROW = ("grpo", "rloo", "opo")
"""Outcome estimators whose token advantages are a per-row scalar times the mask (no whitening over the batch)."""


def per_row_path(alg) -> bool:
    """grpo (Dr.GRPO), rloo, opo without KL in the reward or distillation: no (N, L) tensor is needed."""
    return alg.adv_estimator in PER_ROW and not alg.use_kl_in_reward and not alg.distillation.enable


def model_token_counts(scored: Partition, kept: pd.DataFrame, batch_rows: int | None) -> torch.Tensor:
    """(N,) float32 model tokens per kept rollout (the mask's row sums): its response_length, less the observation
    tokens of its response_mask, counted a batch at a time."""
    lengths = kept["response_length"].to_numpy(dtype=np.int64)
    counts = torch.as_tensor(lengths, dtype=torch.float32)
    if "response_mask" not in scored.columns():
        return counts
    for first, rows in kept_batches(scored, kept, ["response_mask"], batch_rows):
        masks, sub = masks_of(rows), lengths[first : first + rows.num_rows]
        if masks is not None:
            counts[first : first + rows.num_rows] = loss_mask(sub.tolist(), max(1, int(sub.max())), masks).sum(-1)
    return counts


def row_advantages(cfg: RunConfig, kept: pd.DataFrame, counts: torch.Tensor) -> Outputs:
    """compute_advantages' numbers for a per_row_path estimator from (N,) scalars: the outcome score (the masked
    sum of outcome_to_token_rewards' row, the reward itself or 0 without a model token; + 0.0 as the sum's -0.0)
    and the model-token counts (opo's lengths)."""
    alg, rewards = cfg.algorithm, finite_rewards(kept)
    r = torch.tensor(rewards, dtype=torch.float32)
    scores = torch.where(counts > 0, r, torch.zeros_like(r)) + 0.0  # (N,)
    group_ids = torch.tensor(kept["group_id"].to_numpy(dtype=np.int64))
    if alg.adv_estimator == "grpo":
        adv = compute_grpo_advantages(scores, group_ids, scale_by_std=alg.norm_adv_by_std_in_grpo)
    elif alg.adv_estimator == "rloo":
        adv = compute_rloo_advantages(scores, group_ids)
    else:
        adv = compute_opo_advantages(scores, counts, group_ids)
    nan = np.full(len(kept), np.nan)
    return Outputs(adv, None, rewards, {"kl_coef": nan, "reward_kl": nan, "teacher_kl": nan})


def dense_advantages(cfg: RunConfig, kept, baselines, joined: dict, mask, engine_lp, kl_coef):
    """Outputs (advantages (N, L), returns (N, L)): the math of stages.advantage_table.compute_advantage_table on the
    same dense tensors, so the same numbers."""
    alg, (n, width) = cfg.algorithm, mask.shape
    baseline_rewards = remax_baseline_rewards(kept, baselines) if alg.adv_estimator == "remax" else None
    rewards = finite_rewards(kept)
    token_rewards = outcome_to_token_rewards(torch.tensor(rewards, dtype=torch.float32), mask)  # (N, L)
    cols = {"kl_coef": np.full(n, np.nan), "reward_kl": np.full(n, np.nan), "teacher_kl": np.full(n, np.nan)}
    student = engine_lp  # the engine's log-probs without an old_logprobs table, as the whole-frame path
    if "old" in joined and (alg.use_kl_in_reward or alg.distillation.enable):
        student = padded(joined["old"], width)  # (N, L) the actor's recomputed log-probs
    if alg.use_kl_in_reward:
        ref_lp = padded(joined["ref"], width)  # (N, L)
        token_rewards, kl_cols = kl_in_reward(alg, token_rewards, mask, student, ref_lp, kl_coef)
        cols |= kl_cols
    gae_values = padded(joined["values"], width) if alg.adv_estimator == "gae" else None
    adv, returns = estimate(alg, token_rewards, mask, kept["group_id"], gae_values, baseline_rewards)
    if alg.distillation.enable:
        teacher = padded(joined["teacher"], width)  # (N, L)
        adv, cols["teacher_kl"] = distilled(adv, student, teacher, mask, alg.distillation)
    return Outputs(adv, returns, rewards, cols)


def arrow_series(array: pa.Array | pa.ChunkedArray) -> pd.Series:
    """A pandas column over Arrow buffers (no Python object per row or value); the writer takes it as is."""
    return pd.Series(pd.arrays.ArrowExtensionArray(array))


def list_column(values: np.ndarray, lengths: np.ndarray) -> pd.Series:
    """A list column from its rows' values end to end and the rows' lengths."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return arrow_series(pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)))


def token_lists(t: torch.Tensor, lengths: np.ndarray) -> pd.Series:
    """Each row's first lengths[i] values of t (k, L'): what [t[i, :n].tolist() ...] holds, as list<float>."""
    return list_column(t.numpy()[np.arange(t.shape[1])[None, :] < lengths[:, None]], lengths)


def output_frames(
    cfg: RunConfig, scored: Partition, kept, out: Outputs, firsts: list, batch_rows
) -> Iterator[pd.DataFrame]:
    """Pass 3: the advantages table a batch of scored_rollouts at a time, compute_advantage_table's columns less
    the joined ones (tables.ADVANTAGE_JOINS; the list columns over Arrow buffers); each batch's `advantage` column
    is appended to `firsts`."""
    has, lengths = set(scored.columns()), kept["response_length"].to_numpy(dtype=np.int64)
    for first, rows in kept_batches(scored, kept, [c for c in MASK if c in has], batch_rows):
        sl, masks = slice(first, first + rows.num_rows), masks_of(rows)
        a, r = out.token_rows(first, lengths[sl], masks)
        firsts.append(a[:, 0].numpy().copy())  # not a view: it would keep the whole (k, L') rows alive
        advantages = token_lists(a, lengths[sl])
        yield pd.DataFrame(
            {
                **{key: kept[key].to_numpy()[sl] for key in ("rollout_id", "group_id", "policy_version")},
                "reward": out.rewards[sl],
                "advantage": firsts[-1],
                "token_advantages": advantages,
                "adv_estimator": cfg.algorithm.adv_estimator,
                **{key: out.cols[key][sl] for key in ("kl_coef", "reward_kl", "teacher_kl")},
                "returns": advantages if r is a else token_lists(r, lengths[sl]),
            }
        )


def joins_of(cfg: RunConfig, up: Upstream) -> list[str]:
    """The upstream tables this run joins by rollout_id, after the whole-frame path's checks that they exist."""
    alg = cfg.algorithm
    needed = {"old": True, "ref": True, "values": alg.adv_estimator == "gae", "teacher": alg.distillation.enable}
    missing = {
        "values": "adv_estimator='gae' needs the iteration's critic values (the `values` table); materialize the "
        "`values` asset of this iteration first, or pick another estimator",
        "ref": "algorithm.use_kl_in_reward=True needs the iteration's ref_logprobs table; materialize the "
        "ref_logprobs asset of this iteration first, or set use_kl_in_reward=false",
        "teacher": "algorithm.distillation.enable=true needs the iteration's teacher_logprobs table, because the "
        "distillation advantage compares the student's log-probs with the teacher's; materialize the "
        "teacher_logprobs asset of this iteration first, or set algorithm.distillation.enable=false",
    }
    must = {"values": needed["values"], "ref": alg.use_kl_in_reward, "teacher": needed["teacher"]}
    for which, required in must.items():
        if required and getattr(up, which) is None:
            raise ValueError(missing[which])
    return [w for w, need in needed.items() if need and getattr(up, w) is not None]


def joined_tables(joins: list[str]) -> list[str]:
    """The tables whose columns the advantages rows' readers join (tables.ADVANTAGE_JOINS), those this run's table
    had copied: rollouts, and the joined upstream tables but values (its values are in `returns`)."""
    return ["rollouts", *(JOINS[w][2] for w in joins if w != "values")]


def whole_frame(cfg: RunConfig, up: Upstream, target_uri: str, *, lineage) -> AdvantageRun:
    """The explicit fallback (module docstring): every partition read whole, stages.advantage_table's computation."""

    def read(part: Partition | None) -> pd.DataFrame | None:
        return None if part is None else pd.concat(list(part.batches()), ignore_index=True)

    frames = {k: read(getattr(up, k)) for k in ("values", "ref", "previous", "old", "teacher")}
    adv, dropped = iteration_advantages(cfg, read(up.scored), **frames)
    adv, s = adv.drop(columns=[c for c in JOINED if c in adv]), up.scored  # the readers join them
    lineage = with_joins(lineage, joined_tables(joins_of(cfg, up)))
    version = write_frames([adv], target_uri, "advantages", run_id=s.run_id, iteration=s.iteration, lineage=lineage)
    return AdvantageRun(version, adv[SUMMARY].copy(), dropped, "whole-frame")


def stream_advantages(
    cfg: RunConfig, up: Upstream, target_uri: str, *, lineage, batch_rows: int | None = None
) -> AdvantageRun:
    """The `advantages` stage (stages.advantage_table.iteration_advantages' rows, order and values) over partition
    handles, written to the table at `target_uri` with ONE commit carrying `lineage` (a mapping or a function
    called once the files are written); the step holds per-row scalars (or the (N, L) tensors), never a whole
    partition's token lists as Python objects."""
    kept, baselines, dropped = selected_rows(cfg, read_scalars(up.scored, batch_rows))
    if (np.diff(kept["_pos"].to_numpy()) <= 0).any():  # kept order != stream order: see the module docstring
        return whole_frame(cfg, up, target_uri, lineage=lineage)
    joins = joins_of(cfg, up)
    alg = cfg.algorithm
    previous = up.previous.read(["kl_coef", "reward_kl"]) if up.previous is not None else None
    kl_coef = kl_coef_for_iteration(alg, previous) if alg.use_kl_in_reward else None
    joined = {w: join(getattr(up, w), w, kept, batch_rows) for w in joins}
    if per_row_path(alg):  # the common case: per-row scalars, no (N, L) tensor
        out = row_advantages(cfg, kept, model_token_counts(up.scored, kept, batch_rows))
    else:
        width = max(1, int(kept["response_length"].to_numpy(dtype=np.int64).max(initial=0)))
        engine_lp = "old" not in joined and (alg.use_kl_in_reward or alg.distillation.enable)
        mask, lp = scored_dense(up.scored, kept, width, engine_lp, batch_rows)
        out = dense_advantages(cfg, kept, baselines, joined, mask, lp, kl_coef)
    s, firsts = up.scored, []
    frames, lineage = output_frames(cfg, s, kept, out, firsts, batch_rows), with_joins(lineage, joined_tables(joins))
    version = write_frames(frames, target_uri, "advantages", run_id=s.run_id, iteration=s.iteration, lineage=lineage)
    summary = pd.DataFrame({"group_id": kept["group_id"].to_numpy(), "advantage": np.concatenate(firsts)})
    summary = summary.assign(kl_coef=out.cols["kl_coef"], teacher_kl=out.cols["teacher_kl"])
    return AdvantageRun(version, summary, dropped, "streamed")
