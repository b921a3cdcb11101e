"""The scored_rollouts stage's reward: score each rollout with the rule-based function of its data_source, or
with your own function (reward.custom_reward_function, verl-compatible: stages/data/custom_reward.py).

Rule rewards hold no model, so they run as stateless Ray tasks (stages/workers/tasks.py map_with_tasks),
one contiguous block per task; a reward model would be a worker class with its own group instead.
A reward function that raises, or returns a non-finite value or something that is not a score, is a clear
error naming the rollout (reward.on_error='raise'), or flags the row with reward_error and reward NaN so
downstream checks can gate it (reward.on_error='flag'). A scorer that runs out of time (math_grader.RewardTimeout:
math_verify over its per-row wall-clock limit) scores 0.0, as verl's timeout_score, with reward_error set, under
either on_error: the row is kept and trained on, and the run never hangs on it.

Every row records which code scored it: reward_fn (module.function) and reward_version
(<file or module>:<function>@<source hash>); a scorer's extra keys (a dict return, verl's reward_extra_info)
become columns named as the keys, listed per row in reward_extra_keys. A custom function's source is read
once on the driver and travels inside the picklable RewardStage, so the Ray tasks need no copy of the file.

DAPO's soft overlong punishment (reward.overlong_buffer, stages.algos.dapo.overlong_reward_penalty)
is added to the task score of training rollouts: `score` keeps the task score, `overlong_penalty`
the shaping term and `reward` = score + overlong_penalty. Validation scores the task alone.
"""

from __future__ import annotations

import functools
import inspect
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from configs.schema import RewardConfig, RunConfig
from stages.algos.dapo import overlong_reward_penalty
from stages.data import custom_reward as custom_reward_module
from stages.data.custom_reward import (
    BatchShapeError,
    CustomReward,
    call_reward_fn,
    check_extra_keys,
    explain_error,
    extra_column,
    load_custom_reward,
    parse_extra_info,
    read_custom_reward,
    split_result,
)
from stages.data.math_grader import RewardTimeout, require_math_verify
from stages.data.rewards import Scorer, scorer_for
from stages.io.stage_exec import Lineage, Partition, StageRun, run_table_stage
from stages.io.tables import ROLLOUT_TOKEN_COLUMNS, SCHEMAS
from stages.judgements import combine_judge_scores
from stages.reward_model import combine_rm_scores, reward_model_reads, reward_model_scores
from stages.workers.tasks import map_with_tasks

_OWN_COLUMNS = frozenset(SCHEMAS["scored_rollouts"].names) | frozenset(ROLLOUT_TOKEN_COLUMNS)
"""Names an extra key may not take: rlake's own scored_rollouts columns."""
_PLUMBING = (__file__, custom_reward_module.__file__)
"""rlake's own frames between the stage and a scorer: never the frame a reward error names."""


class RewardFunctionError(ValueError):
    """A reward function failed on one rollout under reward.on_error='raise': one line naming the function, the
    rollout (rollout_id, prompt_id, data_source), the scorer's own frame (file:line) and its exception, with the
    fix. A plain ValueError subclass with its message as its only argument, so it pickles through Ray intact."""


def scorer_frame(exc: BaseException) -> str:
    """`file:line` of the innermost frame of `exc` outside rlake's reward plumbing and installed libraries
    (the reward function's own code), else of the innermost frame; '' without a traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    own = [f for f in frames if f.filename not in _PLUMBING and "-packages" not in f.filename]
    for f in own[-1:] or frames[-1:]:
        return f"{f.filename}:{f.lineno}"
    return ""


@functools.cache
def _params(fn: Callable[..., float]) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def _option_kw(fn: Callable[..., float], options: dict[str, str]) -> dict:
    """The stage options `fn` declares a parameter for: `method` (gsm8k family: reward.gsm8k_method),
    `math_method` (MATH: reward.math_method)."""
    return {k: v for k, v in options.items() if k in _params(fn)}


def _verl_rows(batch: pd.DataFrame, positions: list[int]) -> list[dict[str, Any]]:
    """The keyword arguments of verl's compute_score for the rows at `positions` (extra_info parsed to a dict;
    {} for a rollouts table written before the column existed)."""
    info = batch["extra_info"].tolist() if "extra_info" in batch.columns else [None] * len(batch)
    ds, text, gt = batch["data_source"].tolist(), batch["response_text"].tolist(), batch["ground_truth"].tolist()
    return [
        {"data_source": ds[i], "solution_str": text[i], "ground_truth": gt[i], "extra_info": parse_extra_info(info[i])}
        for i in positions
    ]


class RewardStage:
    """A picklable scorer: RewardStage(**options)(rollouts) -> rollouts with reward columns (in this
    process, or in each Ray task of map_with_tasks).

    overlong: {"len", "penalty_factor", "max_response_length"} to shape rewards, or None.
    custom: a user function (its source; read_custom_reward) scoring every row instead of the built-ins.
    """

    def __init__(
        self,
        format_score: float = 0.0,
        score: float = 1.0,
        on_error: str = "raise",
        overlong: dict | None = None,
        gsm8k_method: str = "strict",
        math_method: str = "default",
        custom: CustomReward | None = None,
    ) -> None:
        self.kw = {"format_score": format_score, "score": score}
        self.options = {"method": gsm8k_method, "math_method": math_method}
        self.on_error = on_error
        self.overlong = overlong
        self.custom = custom

    def _builtin(self, fn: Callable[..., Any], text: str, gt: str) -> Any:
        """A built-in scorer's return value for one rollout, or the exception it raised."""
        try:
            return fn(text, gt, **self.kw, **_option_kw(fn, self.options))
        except Exception as exc:  # reported with the row by _outcome
            return exc

    def _returns(self, batch: pd.DataFrame) -> tuple[list[str], list[str], list[Any]]:
        """Per row: (reward_fn, reward_version, the scorer's return value or the exception it raised)."""
        n = len(batch)
        if self.custom is not None:
            fn, c = load_custom_reward(self.custom), self.custom  # a file that fails to import says where
            values = call_reward_fn(
                fn, _verl_rows(batch, list(range(n))), batched=c.batched, reward_kwargs=c.reward_kwargs
            )
            return [c.label] * n, [c.version] * n, values
        names, versions, values = [""] * n, [""] * n, [None] * n
        sources, texts, gts = (
            batch["data_source"].tolist(),
            batch["response_text"].tolist(),
            batch["ground_truth"].tolist(),
        )
        for ds in dict.fromkeys(sources):
            scorer: Scorer = scorer_for(ds)
            rows = [i for i, s in enumerate(sources) if s == ds]
            if scorer.verl_call:
                got = call_reward_fn(scorer.fn, _verl_rows(batch, rows))
            else:
                got = [self._builtin(scorer.fn, texts[i], gts[i]) for i in rows]
            name, version = scorer.name, scorer.version
            for i, value in zip(rows, got, strict=True):
                names[i], versions[i], values[i] = name, version, value
        return names, versions, values

    def _outcome(self, name: str, row: tuple, value: Any) -> tuple[float, dict[str, Any], str | None]:
        """(score, extra keys, reward_error) of one rollout from its scorer's return value or exception, under
        on_error; a timeout is (0.0, {}, its message). row: (data_source, rollout_id, prompt_id or None)."""
        try:
            if isinstance(value, BaseException):
                raise value
            return (*split_result(value), None)
        except RewardTimeout as exc:  # verl's timeout_score 0; flagged, never raised
            return 0.0, {}, f"RewardTimeout: {exc}"
        except Exception as exc:  # user reward code; reported with the row
            if self.on_error == "raise":
                raise self._error(name, row, value, exc) from exc
            return float("nan"), {}, f"{type(exc).__name__}: {exc}"

    @staticmethod
    def _error(name: str, row: tuple, value: Any, exc: Exception) -> RewardFunctionError:
        """The one-line error of a rollout that failed under on_error='raise': the function's own exception
        (at its frame) or what was wrong with its return value."""
        ds, rid, pid = row
        which = f"rollout {rid} (" + ("" if pid is None else f"prompt_id {pid}, ") + f"data_source '{ds}')"
        text = " ".join(str(exc).split())[:300]  # one line, whatever the function put in its message
        if value is exc and not isinstance(exc, BatchShapeError):  # the function itself raised
            where = scorer_frame(exc)
            what = f"raised {'at ' + where + ': ' if where else ''}{type(exc).__name__}: {text}"
        else:  # it returned something that is not a score
            what = text
        return RewardFunctionError(
            f"reward function {name} failed on {which}: {what}. Fix the function (a response it cannot score "
            "should score 0.0), or set reward.on_error=flag to train on the other rollouts."
        )

    def _penalty(self, batch: pd.DataFrame) -> list[float]:
        """Each row's overlong penalty (0.0 without reward.overlong_buffer)."""
        if self.overlong is None or not len(batch):
            return [0.0] * len(batch)
        lengths = torch.tensor(batch["response_length"].to_numpy(dtype="int64"))
        o = self.overlong
        return (
            overlong_reward_penalty(lengths, o["max_response_length"], o["len"], o["penalty_factor"]).double().tolist()
        )

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        names, versions, values = self._returns(batch)
        pids = batch["prompt_id"].tolist() if "prompt_id" in batch.columns else [None] * len(batch)
        rows = zip(batch["data_source"], batch["rollout_id"], pids, strict=True)
        outcomes = [self._outcome(name, row, value) for name, row, value in zip(names, rows, values, strict=True)]
        scores = [o[0] for o in outcomes]
        extras = [o[1] for o in outcomes]
        keys = sorted(set().union(*extras))
        check_extra_keys(set(keys), _OWN_COLUMNS | set(batch.columns), " / ".join(sorted(set(names))))
        penalty = self._penalty(batch)
        return batch.assign(
            reward=[s + p for s, p in zip(scores, penalty, strict=True)],
            reward_fn=names,
            reward_error=[o[2] for o in outcomes],
            score=scores,
            overlong_penalty=penalty,
            reward_version=versions,
            reward_extra_keys=[sorted(e) for e in extras],
            **{k: [e.get(k) for e in extras] for k in keys},
        )


def reward_stage(reward_cfg: RewardConfig, data_sources, *, max_response_length: int | None = None) -> RewardStage:
    """The RewardStage of `reward_cfg`, checked before any work: an unknown data source (of `data_sources`, the
    rows' distinct data_source values) or a missing math-verify fails here. A custom function's file is read
    here, once, and travels inside the stage. Overlong shaping applies when reward_cfg.overlong_buffer.enable
    and max_response_length (the generation limit, data.max_response_length) is given."""
    custom = read_custom_reward(reward_cfg.custom_reward_function)
    if custom is None:
        for ds in data_sources:  # unknown data_source: fail before any work
            scorer_for(ds)
        if reward_cfg.math_method == "math_verify":  # missing math-verify: fail before any work
            require_math_verify()
    ob = getattr(reward_cfg, "overlong_buffer", None)
    overlong = None
    if ob is not None and ob.enable and max_response_length is not None:
        overlong = {"len": ob.len, "penalty_factor": ob.penalty_factor, "max_response_length": max_response_length}
    return RewardStage(
        format_score=reward_cfg.format_score,
        score=reward_cfg.score,
        on_error=reward_cfg.on_error,
        overlong=overlong,
        gsm8k_method=reward_cfg.gsm8k_method,
        math_method=reward_cfg.math_method,
        custom=custom,
    )


Combine = Callable[[pd.DataFrame, pd.DataFrame], pd.DataFrame]
"""then(scored block, its rollouts) -> the block with model scores combined into `reward` (ModelScores)."""


class ScoreBatch:
    """A stage executor's batch callable (stages/io/stage_exec.py): one block of rollouts scored, in rollout_id
    order, its extra-key columns typed (what score_rollouts gives for the whole partition, per block); `then`
    combines a reward model's or a judge's scores into it (ModelScores)."""

    def __init__(self, stage: RewardStage, then: Combine | None = None) -> None:
        self.stage, self.then = stage, then

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        rows = batch.sort_values("rollout_id").reset_index(drop=True)
        scored = typed_extras(self.stage(rows))
        return scored if self.then is None else self.then(scored, rows)


@dataclass(frozen=True)
class ModelScores:
    """The model rewards of a block after its rule scores, as score_in_memory combined them for the whole
    partition: the reward model's (reward.reward_model, its group scores the block's rollouts) and then the
    judge's verdicts (`judgements`: rollout_id, judge_score, judge_error of the partition; None: no judge)."""

    cfg: RunConfig
    judgements: pd.DataFrame | None = None

    @property
    def rollout_columns(self) -> tuple[str, ...]:
        """The columns of `rows` __call__ reads: the reward model's (reward_model_reads: their token ids, or their
        texts); the judge's combination reads the scored block only (rollout_id, reward, overlong_penalty)."""
        return reward_model_reads(self.cfg) if self.cfg.reward.reward_model.enable else ()

    def __call__(self, scored: pd.DataFrame, rows: pd.DataFrame) -> pd.DataFrame:
        if self.cfg.reward.reward_model.enable:  # a discriminative reward model (stages/reward_model.py)
            rm = reward_model_scores(self.cfg, rows)
            scored = combine_rm_scores(scored, rm, self.cfg.reward.reward_model.combine)
        if self.judgements is not None:  # a generative judge's verdicts (stages/judgements.py)
            scored = combine_judge_scores(scored, self.judgements, self.cfg.reward.judge.combine)
        return scored


def score_rollouts(
    rollouts: pd.DataFrame, reward_cfg: RewardConfig, *, use_ray: bool = True, max_response_length: int | None = None
) -> pd.DataFrame:
    """Score all rollouts; the output keeps every input column plus reward, reward_fn, reward_error,
    score, overlong_penalty, reward_version, reward_extra_keys and one column per extra key (one type each).
    (reward_stage: the checks, overlong shaping.) The scored_rollouts asset streams the partition through
    ScoreBatch instead (score_partition); this is for frames already in memory (evaluation, rollout filters)."""
    stage = reward_stage(reward_cfg, rollouts["data_source"].unique(), max_response_length=max_response_length)
    if not use_ray:
        return typed_extras(stage(rollouts))
    parts = max(1, min(reward_cfg.num_workers, len(rollouts)))
    out = map_with_tasks(rollouts, stage, parts=parts, num_cpus=0.5)
    return typed_extras(out.sort_values("rollout_id").reset_index(drop=True))


def score_partition(
    reward_cfg: RewardConfig,
    source_uri: str,
    target_uri: str,
    *,
    run_id: str,
    iteration: int,
    version: int | None,
    lineage: Lineage,
    max_response_length: int | None = None,
    data_min_rows: int | None = None,
    then: Combine | None = None,
) -> StageRun:
    """The scored_rollouts stage on the stage executor: partition (run_id, iteration) of the rollouts table at
    `source_uri` as of `version`, scored block by block (ScoreBatch) and written as that partition of
    scored_rollouts at `target_uri` in one commit; in this process, or on Ray Data from `data_min_rows` rows.
    Only the data_source column is read here whole (the checks of reward_stage). `then` (ModelScores): each block
    also goes to the reward model's or judge's combination, in this process (it calls the run's model groups).
    Of the token columns only those `then` reads are (its rollout_columns: a reward model's ids; a `then` that does
    not say which gets every column): scored_columns."""
    part = Partition(source_uri, run_id, iteration, version)
    sources = part.read(["data_source"])["data_source"].unique()
    stage = reward_stage(reward_cfg, sources, max_response_length=max_response_length)
    reads = () if then is None else getattr(then, "rollout_columns", None)
    return run_table_stage(
        ScoreBatch(stage, then),
        source_uri,
        target_uri,
        "scored_rollouts",
        run_id=run_id,
        iteration=iteration,
        version=version,
        lineage=lineage,
        data_min_rows=data_min_rows if then is None else None,
        columns=None if reads is None else scored_columns(part.columns(), reads),
    )


SCORER_READS = (
    "rollout_id",
    "prompt_id",
    "data_source",
    "ground_truth",
    "response_text",
    "extra_info",
    "response_length",
)
"""The rollouts columns RewardStage reads: rollout_id (ScoreBatch's order), the built-in scorers' two, a custom or
entry-point function's four arguments (_verl_rows: never the row), prompt_id (an error's row), response_length
(overlong shaping). No token column."""


def scored_columns(rollouts_columns: list[str], also: tuple[str, ...] = ()) -> list[str]:
    """The columns of a rollouts table the stage reads, in its order: all but ROLLOUT_TOKEN_COLUMNS, as scored_rollouts
    copies every other column of a rollout (they hold SCORER_READS; check_extra_keys sees each), and the token
    columns in `also` (ModelScores.rollout_columns: a reward model's prompt_token_ids, response_token_ids)."""
    return [c for c in rollouts_columns if c not in ROLLOUT_TOKEN_COLUMNS or c in also]


def typed_extras(scored: pd.DataFrame) -> pd.DataFrame:
    """The extra-key columns of all blocks given one type each (custom_reward.extra_column); a row without
    a key (another block, a flagged row) holds None."""
    keys = sorted({k for row in scored["reward_extra_keys"] for k in row})
    if not keys:
        return scored
    return scored.assign(**{k: extra_column(k, scored[k].tolist()) for k in keys})


def probe_custom_reward(reward: CustomReward, row: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Call `reward` once on `row` (verl's four arguments) as the stage does: (score, extra keys), or a ValueError
    saying what came back, why the stage cannot use it and how to fix it."""
    fn = load_custom_reward(reward)
    (value,) = call_reward_fn(fn, [row], batched=reward.batched, reward_kwargs=reward.reward_kwargs)
    what = (
        f"{reward.path}: {reward.name}, called once on the first training prompt (data_source "
        f"'{row['data_source']}', its ground truth {row['solution_str']!r:.60} as the response)"
    )
    if isinstance(value, BatchShapeError):
        raise ValueError(f"{what}: {value}; return a list with one number or dict per row.")
    if isinstance(value, BaseException):
        raise ValueError(
            f"{what} raised {explain_error(reward, value)}\nIt would fail the same way on rollouts; fix the "
            "function (a response it cannot parse should score 0.0, not raise)."
        )
    try:
        score, extras = split_result(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} {exc}. Fix what the function returns.") from None
    try:
        check_extra_keys(set(extras), _OWN_COLUMNS, reward.label)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
    return score, extras
