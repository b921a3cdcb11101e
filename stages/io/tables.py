"""Arrow schemas of rlake's Delta tables (one place, so tests and SQL users see one truth)."""

from __future__ import annotations

import pyarrow as pa

_KEYS = [pa.field("run_id", pa.string(), nullable=False), pa.field("iteration", pa.int64(), nullable=False)]
_MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
_TOKENS = pa.list_(pa.int32())
_RESPONSE_MASK = pa.list_(pa.int8())

_TURN_FIELDS = [
    pa.field("turn_index", pa.int32()),
    pa.field("role", pa.string()),  # assistant (model tokens, trained) | tool (an observation, not trained)
    # the turn's tokens are response_token_ids[token_start:token_end]; the spans of a rollout's turns concatenate
    # to its response_token_ids
    pa.field("token_start", pa.int32()),
    pa.field("token_end", pa.int32()),
    pa.field("text", pa.string()),
    pa.field("tool_name", pa.string()),  # tool turns: the tool(s) called by the turn before (comma-separated)
    pa.field("tool_arguments", pa.string()),  # their arguments, JSON (a list when several calls)
    pa.field("observation", pa.string()),  # what the tools returned, as the model saw it (cut, error text)
    pa.field("latency_s", pa.float64()),
    pa.field("error", pa.string()),  # a tool's error or timeout (null: it answered)
]

PROMPT_FIELDS = [
    pa.field("prompt_id", pa.int64(), nullable=False),
    pa.field("split", pa.string()),
    pa.field("data_source", pa.string()),
    pa.field("prompt", _MESSAGES),
    pa.field("ability", pa.string()),
    pa.field("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    pa.field("extra_info", pa.string()),
    pa.field("source_file", pa.string()),
]

ROLLOUT_FIELDS = [
    pa.field("policy_version", pa.int64()),
    pa.field("rollout_id", pa.int64(), nullable=False),
    pa.field("prompt_id", pa.int64()),
    pa.field("group_id", pa.int64()),
    pa.field("sample_index", pa.int32()),
    pa.field("data_source", pa.string()),
    pa.field("ground_truth", pa.string()),
    pa.field("extra_info", pa.string()),  # the prompt's extra_info (JSON), a custom reward function's 4th argument
    pa.field("prompt_text", pa.string()),
    pa.field("prompt_token_ids", _TOKENS),
    pa.field("response_token_ids", _TOKENS),
    pa.field("rollout_logprobs", pa.list_(pa.float32())),
    # multi-turn: 1 = a model token (trained), 0 = an observation token (a tool's output: context only, no loss,
    # no KL, no advantage), one per response token; null = every token is the model's (single-turn rollouts)
    pa.field("response_mask", _RESPONSE_MASK),
    pa.field("response_text", pa.string()),
    pa.field("response_length", pa.int32()),
    pa.field("finish_reason", pa.string()),
    pa.field("engine", pa.string()),
    # how the engine got this policy's weights: build (new engine), in_place (weights reloaded), cached
    pa.field("engine_sync", pa.string()),
    # stages.models.fingerprint of the weights the engine held after that sync (read from the engine's model);
    # differs from fingerprint_checkpoint(policy_version's dir) when the new weights never reached the engine
    pa.field("engine_weights_fingerprint", pa.string()),
    pa.field("gen_round", pa.int32()),  # DAPO dynamic sampling: generation round (0 without it)
    # ReMax: the greedy response of a prompt (sample_index -1), its reward is the group's baseline; never trained on
    pa.field("is_baseline", pa.bool_()),
    # multi-turn: the trajectory's turns in order (null for single-turn rollouts); the `turns` table is their rows
    pa.field("turns", pa.list_(pa.struct(_TURN_FIELDS))),
]

ROLLOUT_TOKEN_COLUMNS = ("prompt_token_ids", "response_token_ids", "rollout_logprobs", "response_mask", "turns")
"""A rollout's per-token columns. Stored once, in `rollouts`: `scored_rollouts` keeps each rollout's other columns
and its rewards, and its readers take the token columns from the rollouts partition it was scored from
(stages/scored_tokens.py; a scored_rollouts partition written before holds copies, which they leave)."""

REWARD_FIELDS = [
    pa.field("reward", pa.float64()),
    pa.field("reward_fn", pa.string()),
    pa.field("reward_error", pa.string()),
    pa.field("score", pa.float64()),  # task score before shaping; reward = score + overlong_penalty
    # the reward model's score and version (reward.reward_model; null without one): then reward = rm_score
    # (combine=replace) or score + rm_score (combine=add), + overlong_penalty
    pa.field("rm_score", pa.float64()),
    pa.field("rm_version", pa.string()),
    # the generative judge's parsed score (null: no judge, or a verdict score_regex could not read, then
    # judge_error says why); reward = judge_score (combine=replace) or score + judge_score (add)
    pa.field("judge_score", pa.float64()),
    pa.field("judge_error", pa.string()),
    pa.field("overlong_penalty", pa.float64()),
    # which code scored the row: <file or module>:<function>@<sha256 of its source, 12 hex> (stages/scored_rollouts.py)
    pa.field("reward_version", pa.string()),
    # the extra keys the reward function returned for this row (verl's reward_extra_info): each is a column
    pa.field("reward_extra_keys", pa.list_(pa.string())),
]

OLD_LOGPROB_FIELDS = [
    pa.field("old_logprobs", pa.list_(pa.float32())),
    # max and mean over the response of |exp(old_logprobs) - exp(rollout_logprobs)| (NaN: empty response)
    pa.field("rollout_probs_diff_max", pa.float64()),
    pa.field("rollout_probs_diff_mean", pa.float64()),
]

ADVANTAGE_JOINS: dict[str, tuple[str, ...]] = {
    "rollouts": ("prompt_token_ids", "response_token_ids", "response_mask", "rollout_logprobs"),
    "old_logprobs": tuple(f.name for f in OLD_LOGPROB_FIELDS),
    "ref_logprobs": ("ref_logprobs",),
    "teacher_logprobs": ("teacher_logprobs",),
}
"""table -> its columns the readers of `advantages` join by rollout_id at the version the advantages commit read
(stages/io/advantage_rows.py; #36: stored once). An advantages partition written before holds copies of them
(ADVANTAGE_COPIES), which its readers take as they are."""

SCHEMAS: dict[str, pa.Schema] = {
    # prompts: iteration -1 holds the ingested dataset of a run
    "prompts": pa.schema(_KEYS + PROMPT_FIELDS),
    "prompt_batches": pa.schema(
        _KEYS
        + [
            pa.field("prompt_id", pa.int64(), nullable=False),
            pa.field("epoch", pa.int64()),
            pa.field("position", pa.int64()),
            pa.field("data_source", pa.string()),
            pa.field("ground_truth", pa.string()),
            pa.field("extra_info", pa.string()),
            pa.field("prompt_text", pa.string()),
            pa.field("prompt_token_ids", _TOKENS),
            pa.field("gen_round", pa.int32()),
        ]
    ),
    "rollouts": pa.schema(_KEYS + ROLLOUT_FIELDS),
    "scored_rollouts": pa.schema(
        _KEYS + [f for f in ROLLOUT_FIELDS if f.name not in ROLLOUT_TOKEN_COLUMNS] + REWARD_FIELDS
    ),
    "advantages": pa.schema(
        _KEYS
        + [
            pa.field("rollout_id", pa.int64(), nullable=False),
            pa.field("group_id", pa.int64()),
            pa.field("policy_version", pa.int64()),
            pa.field("reward", pa.float64()),
            pa.field("advantage", pa.float32()),
            pa.field("token_advantages", pa.list_(pa.float32())),
            pa.field("adv_estimator", pa.string()),
            # the KL-in-reward beta and per-rollout KL (NaN without it); the rows' token columns and log-probs
            # are not copied here: readers join them by rollout_id (ADVANTAGE_JOINS)
            pa.field("kl_coef", pa.float64()),
            pa.field("reward_kl", pa.float64()),
            # on-policy distillation: the rollout's token-mean reverse KL log pi_student - log pi_teacher (NaN
            # without it); token_advantages include its term
            pa.field("teacher_kl", pa.float64()),
            # GAE returns per response token (advantages + values, PPO with a critic); empty for others
            pa.field("returns", pa.list_(pa.float32())),
        ]
    ),
    # per-token critic values of each rollout's response (PPO with GAE), by critic version == iteration
    "values": pa.schema(
        _KEYS
        + [
            pa.field("rollout_id", pa.int64(), nullable=False),
            pa.field("critic_version", pa.int64()),
            pa.field("values", pa.list_(pa.float32())),
        ]
    ),
    # per-token log-probs of each rollout's response under the policy that sampled it (version == iteration),
    # recomputed by the trainer, and their gap to the engine's rollout_logprobs
    "old_logprobs": pa.schema(
        _KEYS
        + [
            pa.field("rollout_id", pa.int64(), nullable=False),
            pa.field("policy_version", pa.int64()),
            *OLD_LOGPROB_FIELDS,
        ]
    ),
    # per-token log-probs of each rollout's response under the reference policy (version 0)
    "ref_logprobs": pa.schema(
        _KEYS
        + [
            pa.field("rollout_id", pa.int64(), nullable=False),
            pa.field("policy_version", pa.int64()),
            pa.field("ref_policy_version", pa.int64()),
            pa.field("ref_logprobs", pa.list_(pa.float32())),
        ]
    ),
    # per-token log-probs of each rollout's response under the on-policy distillation teacher (algorithm.distillation)
    "teacher_logprobs": pa.schema(
        _KEYS
        + [
            pa.field("rollout_id", pa.int64(), nullable=False),
            pa.field("policy_version", pa.int64()),
            pa.field("teacher_logprobs", pa.list_(pa.float32())),
        ]
    ),
    # the generative judge's prompt and raw verdict per training rollout (reward.judge), and what was read from it
    "judgements": pa.schema(
        _KEYS
        + [
            pa.field("rollout_id", pa.int64(), nullable=False),
            pa.field("policy_version", pa.int64()),
            pa.field("judge_prompt", pa.string()),
            pa.field("judge_output", pa.string()),
            pa.field("judge_score", pa.float64()),
            pa.field("judge_error", pa.string()),
            pa.field("judge_model", pa.string()),
        ]
    ),
    # multi-turn rollouts (rollout.multi_turn): one row per turn of each rollout, assistant and tool turns in order
    "turns": pa.schema(
        _KEYS
        + [
            pa.field("rollout_id", pa.int64(), nullable=False),
            pa.field("policy_version", pa.int64()),
            pa.field("prompt_id", pa.int64()),
            *_TURN_FIELDS,
        ]
    ),
    # one row per committed checkpoint (stages.io.checkpoints): iteration = the iteration whose stage wrote it
    # (policy/critic version v is written by iteration v-1; version 0 at -1 for the policy, 0 for the critic),
    # uri = where its files are, metrics = the update's metrics (JSON); lineage in the commit metadata
    "checkpoints": pa.schema(
        _KEYS
        + [
            pa.field("kind", pa.string(), nullable=False),
            pa.field("version", pa.int64(), nullable=False),
            pa.field("checkpoint_id", pa.string(), nullable=False),
            pa.field("attempt_id", pa.string()),
            pa.field("uri", pa.string()),
            pa.field("files", pa.list_(pa.string())),
            pa.field("bytes", pa.int64()),
            pa.field("metrics", pa.string()),
        ]
    ),
    # workers: where each live worker of the run was at the end of the iteration (role, rank, Ray node,
    # process, resources and placement-group bundle, torch threads and device): the recorded placement
    "workers": pa.schema(
        _KEYS
        + [
            pa.field("role", pa.string(), nullable=False),
            pa.field("rank", pa.int64(), nullable=False),
            pa.field("actor_name", pa.string()),
            pa.field("node_id", pa.string()),
            pa.field("node_ip", pa.string()),
            pa.field("pid", pa.int64()),
            pa.field("threads", pa.int64()),
            pa.field("device", pa.string()),
            pa.field("resources", pa.string()),
            pa.field("placement_group", pa.string()),
            pa.field("bundle_index", pa.int64()),
        ]
    ),
    "iteration_metrics": pa.schema(
        _KEYS
        + [
            pa.field("policy_version", pa.int64()),
            pa.field("metric", pa.string(), nullable=False),
            pa.field("value", pa.float64()),
        ]
    ),
}
ADVANTAGE_COPIES = [
    pa.field("prompt_token_ids", _TOKENS),
    pa.field("response_token_ids", _TOKENS),
    pa.field("response_mask", _RESPONSE_MASK),
    pa.field("rollout_logprobs", pa.list_(pa.float32())),
    *OLD_LOGPROB_FIELDS,
    pa.field("ref_logprobs", pa.list_(pa.float32())),
    pa.field("teacher_logprobs", pa.list_(pa.float32())),
]
"""The ADVANTAGE_JOINS columns as an advantages partition of an older rlake holds them: store.to_arrow keeps those a
frame has (tests write that layout), and never adds one."""
LEGACY_FIELDS: dict[str, list[pa.Field]] = {"advantages": ADVANTAGE_COPIES}
PROMPTS_ITERATION = -1
COLUMN_DEFAULTS: dict[str, object] = {
    "gen_round": 0,
    "is_baseline": False,
    "ref_logprobs": [],
    "old_logprobs": [],
    "rollout_logprobs": [],
    "rollout_probs_diff_max": None,
    "rollout_probs_diff_mean": None,
    "rm_score": None,
    "rm_version": None,
    "judge_score": None,
    "judge_error": None,
    "kl_coef": None,
    "reward_kl": None,
    "teacher_logprobs": [],
    "teacher_kl": None,
    "returns": [],
    "extra_info": None,
    "reward_version": None,
    "reward_extra_keys": [],
    "response_mask": None,
    "turns": None,
}
"""Values of columns a writer may omit (added by algorithms that not every run uses): store.to_arrow fills them."""
EXTRA_COLUMNS: dict[str, str] = {"scored_rollouts": "reward_extra_keys"}
"""Tables that keep columns beyond their schema: the union of the listed column's per-row names (a custom reward
function's extra keys), typed as the values are; a later commit that adds one merges it into the table schema."""
COMMIT_SETS: dict[str, str] = {"reward_version": "reward_versions"}
"""column -> lineage key: every commit of a table with that column records the sorted set of its values
(commit metadata rlake.reward_versions, read back by store.commit_lineage as a list)."""
