"""The scored_rollouts stage's reward: score each rollout with the rule-based function of its data_source.

Rule rewards hold no model, so they run as stateless Ray tasks (stages/workers/tasks.py map_with_tasks),
one contiguous block per task; a reward model would be a worker class with its own group instead.
A reward function that raises, or returns a non-finite value, is a clear error naming the rollout
(reward.on_error='raise'), or flags the row with reward_error and reward NaN so downstream checks can
gate it (reward.on_error='flag'). A scorer that runs out of time (math_grader.RewardTimeout: math_verify
over its per-row wall-clock limit) scores 0.0, as verl's timeout_score, with reward_error set, under
either on_error: the row is kept and trained on, and the run never hangs on it.

DAPO's soft overlong punishment (reward.overlong_buffer, stages.algos.dapo.overlong_reward_penalty)
is added to the task score of training rollouts: `score` keeps the task score, `overlong_penalty`
the shaping term and `reward` = score + overlong_penalty. Validation scores the task alone.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable

import pandas as pd
import torch

from configs.schema import RewardConfig
from stages.algos.dapo import overlong_reward_penalty
from stages.data.math_grader import RewardTimeout, require_math_verify
from stages.data.rewards import reward_fn_for
from stages.workers.tasks import map_with_tasks


@functools.cache
def _params(fn: Callable[..., float]) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def _option_kw(fn: Callable[..., float], options: dict[str, str]) -> dict:
    """The stage options `fn` declares a parameter for: `method` (gsm8k family: reward.gsm8k_method),
    `math_method` (MATH: reward.math_method)."""
    return {k: v for k, v in options.items() if k in _params(fn)}


class RewardStage:
    """A picklable scorer: RewardStage(**options)(rollouts) -> rollouts with reward columns (in this
    process, or in each Ray task of map_with_tasks).

    overlong: {"len", "penalty_factor", "max_response_length"} to shape rewards, or None.
    """

    def __init__(
        self,
        format_score: float = 0.0,
        score: float = 1.0,
        on_error: str = "raise",
        overlong: dict | None = None,
        gsm8k_method: str = "strict",
        math_method: str = "default",
    ) -> None:
        self.kw = {"format_score": format_score, "score": score}
        self.options = {"method": gsm8k_method, "math_method": math_method}
        self.on_error = on_error
        self.overlong = overlong

    def _score_one(self, fn: Callable[..., float], ds: str, rid: int, text: str, gt: str) -> tuple[float, str | None]:
        """(score, reward_error) of one rollout under on_error; a timeout is (0.0, its message)."""
        try:
            value = float(fn(text, gt, **self.kw, **_option_kw(fn, self.options)))
            if not math.isfinite(value):
                raise ValueError(f"returned non-finite {value}")
            return value, None
        except RewardTimeout as exc:  # verl's timeout_score 0; flagged, never raised
            return 0.0, f"RewardTimeout: {exc}"
        except Exception as exc:  # user reward code; reported with the row
            if self.on_error == "raise":
                raise ValueError(
                    f"reward function {fn.__name__} for data_source '{ds}' failed on rollout "
                    f"{rid}: {exc}. Fix the function or set reward.on_error='flag'."
                ) from exc
            return float("nan"), f"{type(exc).__name__}: {exc}"

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        scores, names, errors = [], [], []
        for rid, ds, text, gt in zip(
            batch["rollout_id"], batch["data_source"], batch["response_text"], batch["ground_truth"], strict=True
        ):
            fn = reward_fn_for(ds)
            value, err = self._score_one(fn, ds, rid, text, gt)
            scores.append(value)
            names.append(f"{fn.__module__}.{fn.__name__}")
            errors.append(err)
        penalty = [0.0] * len(batch)
        if self.overlong is not None and len(batch):
            lengths = torch.tensor(batch["response_length"].to_numpy(dtype="int64"))
            penalty = (
                overlong_reward_penalty(
                    lengths, self.overlong["max_response_length"], self.overlong["len"], self.overlong["penalty_factor"]
                )
                .double()
                .tolist()
            )
        rewards = [s + p for s, p in zip(scores, penalty, strict=True)]
        return batch.assign(
            reward=rewards, reward_fn=names, reward_error=errors, score=scores, overlong_penalty=penalty
        )


def score_rollouts(
    rollouts: pd.DataFrame, reward_cfg: RewardConfig, *, use_ray: bool = True, max_response_length: int | None = None
) -> pd.DataFrame:
    """Score all rollouts; the output keeps every input column plus reward, reward_fn, reward_error,
    score and overlong_penalty. Overlong shaping applies when reward_cfg.overlong_buffer.enable and
    max_response_length (the generation limit, data.max_response_length) is given."""
    for ds in rollouts["data_source"].unique():  # unknown data_source: fail before any work
        reward_fn_for(ds)
    if reward_cfg.math_method == "math_verify":  # missing math-verify: fail before any work
        require_math_verify()
    ob = getattr(reward_cfg, "overlong_buffer", None)
    overlong = None
    if ob is not None and ob.enable and max_response_length is not None:
        overlong = {"len": ob.len, "penalty_factor": ob.penalty_factor, "max_response_length": max_response_length}
    kwargs = {
        "format_score": reward_cfg.format_score,
        "score": reward_cfg.score,
        "on_error": reward_cfg.on_error,
        "overlong": overlong,
        "gsm8k_method": reward_cfg.gsm8k_method,
        "math_method": reward_cfg.math_method,
    }
    if not use_ray:
        return RewardStage(**kwargs)(rollouts)
    parts = max(1, min(reward_cfg.num_workers, len(rollouts)))
    out = map_with_tasks(rollouts, RewardStage(**kwargs), parts=parts, num_cpus=0.5)
    return out.sort_values("rollout_id").reset_index(drop=True)
