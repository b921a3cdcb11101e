"""The `reward` section: rule scorers, custom reward function, overlong buffer, reward model, judge."""

from __future__ import annotations

import re
import string
from typing import Any, Literal

from pydantic import model_validator

from configs.sections.base import _Strict


class OverlongBufferConfig(_Strict):
    """DAPO soft overlong punishment (verl's overlong_buffer): penalty ramping from 0 to -penalty_factor
    over the last `len` tokens before data.max_response_length."""

    enable: bool = False
    len: int = 4
    """L_cache: tokens of the ramp, 0 < len <= data.max_response_length."""
    penalty_factor: float = 1.0


class RewardModelConfig(_Strict):
    """A discriminative reward model (verl's reward_model.*): a local HF *ForSequenceClassification
    checkpoint with one label, scoring each training rollout's prompt + response at its last token
    (stages/reward_model.py). Validation keeps the rule reward, as verl validates rule-based only."""

    enable: bool = False
    """Score training rollouts with the reward model too (scored_rollouts gets rm_score, rm_version)."""
    model_path: str | None = None
    """Local checkpoint directory of the reward model (config.json architectures *ForSequenceClassification,
    num_labels 1, a tokenizer); required with enable."""
    micro_batch_size: int = 8
    """Rollouts per reward-model forward."""
    max_length: int = 512
    """Most reward-model tokens of prompt + response; a longer one loses the start of its prompt (left
    truncation), so the response's end, where the score is read, is always kept."""
    combine: Literal["replace", "add"] = "replace"
    """How rm_score enters `reward`. replace: reward = rm_score, verl's behaviour (with rm_scores in the
    batch its reward managers return them and never call the rule function); add: reward = rule score +
    rm_score (not in verl). Both: `score` keeps the rule score, the overlong penalty is added on top."""

    @model_validator(mode="after")
    def _check_model(self) -> RewardModelConfig:
        if self.enable and not self.model_path:
            raise ValueError(
                "reward.reward_model.enable=true needs reward.reward_model.model_path, because the reward "
                "model is loaded from a local checkpoint directory; set model_path=<dir with config.json> "
                "or reward.reward_model.enable=false."
            )
        if self.micro_batch_size < 1 or self.max_length < 1:
            raise ValueError(
                f"reward.reward_model.micro_batch_size ({self.micro_batch_size}) and max_length "
                f"({self.max_length}) must be >= 1, because they size each reward-model forward; raise them."
            )
        return self


JUDGE_PLACEHOLDERS = ("question", "response", "ground_truth")

DEFAULT_JUDGE_TEMPLATE = (
    "Grade the answer to the question against the reference answer.\n"
    "Question: {question}\nAnswer: {response}\nReference answer: {ground_truth}\n"
    "Reply with 'Score: 1' if the answer is correct and 'Score: 0' if it is not."
)


class JudgeConfig(_Strict):
    """A generative judge (LLM-as-judge): a local causal-LM checkpoint, served by rollout engines of
    rollout.name (HF or vLLM) on a persistent "judge" worker group, reads prompt_template filled with each
    training rollout's question, response and ground truth and answers; score_regex reads the score
    (stages/judgements.py). Prompts and verdicts go to the `judgements` table. Validation keeps the rule reward."""

    enable: bool = False
    """Judge training rollouts (scored_rollouts gets judge_score, judge_error; a judgements table is written)."""
    model_path: str | None = None
    """Local causal-LM checkpoint directory of the judge (config.json + tokenizer); required with enable."""
    prompt_template: str = DEFAULT_JUDGE_TEMPLATE
    """The judge's user message; Python str.format placeholders {question} (the rollout's last user message),
    {response} (required) and {ground_truth}; literal braces doubled ({{ }})."""
    score_regex: str = r"Score:\s*(-?\d+(?:\.\d+)?)"
    """Regular expression searched in the verdict; its first group, as a float, is judge_score. No match (or
    not a number): judge_score null, judge_error says why, and the judge adds nothing to that reward."""
    temperature: float = 0.0
    """Judge sampling temperature; 0 = greedy (deterministic verdicts)."""
    max_tokens: int = 32
    """Most tokens of a verdict."""
    num_workers: int = 1
    """Judge engines (RolloutWorkers of the "judge" group)."""
    combine: Literal["replace", "add"] = "replace"
    """How judge_score enters `reward`: replace (reward = judge_score) or add (rule score + judge_score); the
    overlong penalty stays added on top, `score` keeps the rule score."""

    @model_validator(mode="after")
    def _check_judge(self) -> JudgeConfig:
        if self.enable and not self.model_path:
            raise ValueError(
                "reward.judge.enable=true needs reward.judge.model_path, because the judge is loaded from a "
                "local checkpoint directory; set model_path=<dir with config.json> or reward.judge.enable=false."
            )
        fields = {f for _, f, _, _ in string.Formatter().parse(self.prompt_template) if f is not None}
        unknown = sorted(fields - set(JUDGE_PLACEHOLDERS))
        if unknown or "response" not in fields:
            raise ValueError(
                f"reward.judge.prompt_template has placeholders {sorted(fields)}: "
                + (f"{unknown} are unknown" if unknown else "{response} is missing")
                + f", because the template is filled with {list(JUDGE_PLACEHOLDERS)} per rollout and the judge "
                "must see the response; use only those names (double literal braces: {{ }})."
            )
        try:
            groups = re.compile(self.score_regex).groups
        except re.error as exc:
            raise ValueError(
                f"reward.judge.score_regex {self.score_regex!r} is not a regular expression ({exc}); fix it, "
                r"e.g. 'Score:\s*(-?\d+(?:\.\d+)?)'."
            ) from None
        if groups < 1:
            raise ValueError(
                f"reward.judge.score_regex {self.score_regex!r} has no capture group, because the score is read "
                r"from the first group; wrap the number in parentheses, e.g. 'Score:\s*(-?\d+(?:\.\d+)?)'."
            )
        if self.temperature < 0 or self.max_tokens < 1 or self.num_workers < 1:
            raise ValueError(
                f"reward.judge.temperature ({self.temperature}) must be >= 0 and max_tokens ({self.max_tokens}) "
                f"and num_workers ({self.num_workers}) >= 1, because they size the judge's generation; fix them."
            )
        return self


class CustomRewardFunctionConfig(_Strict):
    """Your own reward function, verl's reward.custom_reward_function: when `path` is set it scores every
    rollout, whatever its data_source, in place of the built-in scorers (stages/data/custom_reward.py)."""

    path: str | None = None
    """Python file defining the function (read once on the driver; its source ships to the Ray workers, so the
    file need not exist on other nodes). null = the built-in scorers by data_source."""
    name: str = "compute_score"
    """The function in that file: name(data_source, solution_str, ground_truth, extra_info=None, **kwargs) ->
    float or {"score": float, ...}; each extra key becomes a scored_rollouts column. `async def` works too."""
    batched: bool = False
    """True: the function takes lists (data_sources, solution_strs, ground_truths, extra_infos) and returns one
    result per row, as verl's batch reward manager; called once per block of rows."""
    reward_kwargs: dict[str, Any] = {}
    """Extra keyword arguments of every call (verl's custom_reward_function.reward_kwargs)."""

    @model_validator(mode="after")
    def _check_kwargs(self) -> CustomRewardFunctionConfig:
        per_row = {"data_source", "solution_str", "ground_truth", "extra_info"}
        taken = sorted(set(self.reward_kwargs) & (per_row | {f"{k}s" for k in per_row}))
        if taken:
            raise ValueError(
                f"reward.custom_reward_function.reward_kwargs sets {taken}, but rlake passes those from each "
                "rollout, so a config value cannot replace them; remove them from reward_kwargs."
            )
        return self


class RewardConfig(_Strict):
    format_score: float = 0.0
    """Score for a well-formed but wrong answer (verl's gsm8k format_score)."""
    score: float = 1.0
    """Score for a correct answer."""
    gsm8k_method: Literal["strict", "flexible"] = "strict"
    """Answer extraction of the gsm8k-family scorers (verl's gsm8k compute_score `method`): strict = the
    last '#### N'; flexible = the last number in the response's final 300 characters."""
    math_method: Literal["default", "math_verify"] = "default"
    """Scorer of the MATH data_sources (lighteval/MATH, DigitalLearningGmbH/MATH-lighteval,
    HuggingFaceH4/MATH-500): default = verl's Hendrycks string match of the last boxed answer
    (math_reward.py); math_verify = verl's math_verify.py (symbolic equivalence; needs the `math`
    extra, pip install 'rlake[math]'; a row over 30 s scores 0.0 with reward_error set)."""
    num_workers: int = 2
    """Parallel Ray tasks scoring rewards (the batch is split into this many blocks)."""
    on_error: Literal["raise", "flag"] = "raise"
    """A reward function that raises or returns NaN: stop with the row named, or flag the row
    (reward NaN, reward_error set) and let the blocking asset check stop the iteration."""
    custom_reward_function: CustomRewardFunctionConfig = CustomRewardFunctionConfig()
    """Your own reward function (a Python file), verl-compatible; off (null path) by default."""
    overlong_buffer: OverlongBufferConfig = OverlongBufferConfig()
    """Overlong reward shaping of training rewards (validation scores the task reward alone)."""
    reward_model: RewardModelConfig = RewardModelConfig()
    """A discriminative reward model scoring training rollouts (off by default)."""
    judge: JudgeConfig = JudgeConfig()
    """A generative judge (LLM-as-judge) scoring training rollouts (off by default)."""
