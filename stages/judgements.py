"""The judgements stage (LLM-as-judge, reward.judge): a generative judge model reads each rollout's
question, response and ground truth through reward.judge.prompt_template and writes a verdict; the
first capture group of reward.judge.score_regex in the verdict is the rollout's judge_score.

Flow: assets/judgements.py `materialize` -> `judge_rollouts(cfg, rollouts, prompts, iteration, sink)`: each rank of
the run's "judge" worker group — RolloutWorkers (stages/workers/rollout_worker.py), the same engine hosts as
rollouts (rollout.name: HF or vLLM), holding the judge checkpoint for the whole run — reads its slice of the
rollouts partition, builds its judge prompts (chat template of the judge's tokenizer), generates, parses the
verdicts and writes its rows; the asset commits them once (stages/workers/sharded.py). The `judgements` table
keeps every prompt, raw verdict, parsed score and parse error with lineage; the scored_rollouts stage
combines judge_score with the rule reward (`combine_judge_scores`: replace or add).

A verdict the regex does not match, or whose match is not a number, is a flagged row, not a crash:
judge_score is null, judge_error says why, and the judge adds nothing to that rollout's reward (replace:
reward 0; add: the rule reward alone). The count is in the asset's metadata (`judge_unparsed`).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow.compute as pc

from configs.schema import JudgeConfig, RunConfig
from stages import seeds
from stages.io.checkpoints import model_version
from stages.io.stage_exec import Partition
from stages.io.store import read_partition
from stages.models.engines import SamplingSpec
from stages.models.policy import encode_chat, load_tokenizer
from stages.workers.group import WorkerGroup, engine_threads, worker_group
from stages.workers.placement import CPU_ONLY, GpuPool
from stages.workers.rollout_worker import RolloutWorker
from stages.workers.shard_io import ShardResult, Sink
from stages.workers.sharded import local_group, sharded_run

JUDGE_COLUMNS = ("judge_score", "judge_error")
"""What the judge adds to each scored_rollouts row."""


def judge_prompt_texts(rows: pd.DataFrame, template: str) -> list[str]:
    """reward.judge.prompt_template filled per row: {question} (the user prompt), {response}, {ground_truth}."""
    return [
        template.format(question=q, response=r, ground_truth=g)
        for q, r, g in zip(rows["question"], rows["response_text"], rows["ground_truth"], strict=True)
    ]


def parse_verdict(text: str, score_regex: str) -> tuple[float | None, str | None]:
    """(score, None) from the first match's first group, or (None, why) when there is no number to read."""
    match = re.search(score_regex, text)
    if match is None:
        return None, f"score_regex {score_regex!r} does not match the judge's output"
    try:
        value = float(match.group(1))
    except ValueError:
        return None, f"score_regex matched {match.group(1)!r}, which is not a number"
    if not np.isfinite(value):
        return None, f"score_regex matched {match.group(1)!r}, which is not finite"
    return value, None


def questions_of(rollouts: pd.DataFrame, prompts: pd.DataFrame | None) -> pd.Series:
    """Each rollout's question: the content of the last user message of its prompt (prompts table), or the
    chat-templated prompt_text when the prompts table has no row for it."""
    text = rollouts["prompt_text"].astype(str)
    if prompts is None or not len(prompts):
        return text
    last_user = {
        int(pid): next((m["content"] for m in reversed(list(msgs)) if m["role"] == "user"), None)
        for pid, msgs in zip(prompts["prompt_id"], prompts["prompt"], strict=True)
    }
    found = rollouts["prompt_id"].map(lambda pid: last_user.get(int(pid)))
    return found.where(found.notna(), text)


def judge_group(
    judge: JudgeConfig, engine: str, gpus: GpuPool = CPU_ONLY, gpu_memory_utilization: float = 0.5
) -> WorkerGroup:
    """The run's "judge" group: judge.num_workers RolloutWorkers of rollout.name's engine (rank i on GPU i of
    the run's GPU pool `gpus`, where vLLM takes gpu_memory_utilization of it: rollout.gpu_memory_utilization)."""
    return worker_group(
        RolloutWorker,
        "judge",
        judge.num_workers,
        threads=engine_threads(judge.num_workers),
        gpus=gpus,
        engine=engine,
        gpu_memory_utilization=gpu_memory_utilization,
    )


READ_COLUMNS = ("rollout_id", "prompt_id", "prompt_text", "response_text", "ground_truth")
"""What a judge rank reads of the rollouts."""


@dataclass(frozen=True)
class JudgeInputs:
    """On the rank (sharded_run's `prepare`): the judge's prompts of the rollouts it read, in rollout_id order:
    prompt_id = rollout_id (the engine seeds a shard by its first prompt_id), the chat-templated prompt token ids,
    and judge_prompt (the filled template). `prompts`: the prompts table's partition (the rank reads the rows of
    its prompt ids), or its rows, or None (the questions are the rollouts' prompt_text)."""

    model_path: str
    template: str
    prompts: Partition | pd.DataFrame | None

    def questions(self, rows: pd.DataFrame) -> pd.Series:
        prompts = self.prompts
        if isinstance(prompts, Partition) and len(rows):
            ids = pc.field("prompt_id").isin(rows["prompt_id"].unique())
            prompts = read_partition(
                prompts.uri, prompts.run_id, prompts.iteration, version=prompts.version,
                columns=["prompt_id", "prompt"], filters=ids,
            )  # fmt: skip
        return questions_of(rows, None if isinstance(prompts, Partition) else prompts)

    def __call__(self, rows: pd.DataFrame) -> pd.DataFrame:
        rows = rows.assign(question=self.questions(rows)).sort_values("rollout_id")
        texts = judge_prompt_texts(rows, self.template)
        tok = load_tokenizer(self.model_path)
        return pd.DataFrame(
            {
                "prompt_id": rows["rollout_id"].to_numpy(),
                "prompt_token_ids": [encode_chat(tok, [{"role": "user", "content": t}])[0] for t in texts],
                "judge_prompt": texts,
            }
        )


def finish_judgements(
    batch: pd.DataFrame, out: pd.DataFrame, *, score_regex: str, judge_model: str, policy_version: int
) -> tuple[pd.DataFrame, dict]:
    """On the rank: the judgements rows of its rollouts (rollout_id, judge_prompt, judge_output, judge_score: null
    when unparsed, judge_error, judge_model, policy_version) in rollout_id order, and a summary for the asset:
    rows, unparsed verdicts, the parsed scores' sum and count, the first verdict."""
    verdicts = dict(zip(out["prompt_id"], out["response_text"], strict=True))
    ids = batch["prompt_id"].to_numpy()  # = rollout_id (JudgeInputs)
    outputs = [verdicts[int(rid)] for rid in ids]
    parsed = [parse_verdict(text, score_regex) for text in outputs]
    scores = np.asarray([np.nan if s is None else s for s, _ in parsed], dtype=np.float64)
    rows = pd.DataFrame(
        {
            "rollout_id": ids,
            "judge_prompt": batch["judge_prompt"].to_numpy(),
            "judge_output": outputs,
            "judge_score": scores,
            "judge_error": [e for _, e in parsed],
            "judge_model": judge_model,
            "policy_version": policy_version,
        }
    )
    kept = scores[np.isfinite(scores)]
    summary = {"rows": len(rows), "unparsed": int(np.isnan(scores).sum()), "score_sum": float(kept.sum())}
    return rows, summary | {"score_n": int(kept.size), "sample": outputs[0] if outputs else None}


def judge_rollouts(
    cfg: RunConfig,
    rollouts: Partition | pd.DataFrame,
    prompts: Partition | pd.DataFrame | None,
    iteration: int,
    *,
    sink: Sink | None = None,
    use_ray: bool = True,
) -> list[ShardResult]:
    """The judgements of an iteration's rollouts on the run's "judge" group: each rank reads its slice of the
    rollouts (a Partition handle) or gets its rows, builds its judge prompts (JudgeInputs), generates the verdicts,
    parses them (finish_judgements) and, with a sink, writes its rows. Contiguous slices in rollout_id order, so
    each rank's engine seed is the one the whole-frame call gave it."""
    judge = cfg.reward.judge
    spec = SamplingSpec(
        temperature=judge.temperature,
        max_tokens=judge.max_tokens,
        n=1,
        seed=seeds.judge(cfg.rollout.seed, iteration),
        greedy=judge.temperature == 0.0,
    )
    finish = functools.partial(
        finish_judgements,
        score_regex=judge.score_regex,
        judge_model=model_version(judge.model_path),
        policy_version=iteration,
    )
    if isinstance(rollouts, pd.DataFrame):
        rollouts = rollouts.sort_values("rollout_id").reset_index(drop=True)
    if isinstance(prompts, Partition) and prompts.version is not None:  # a plain int crosses to the ranks
        prompts = dataclasses.replace(prompts, version=int(prompts.version))
    return sharded_run(
        lambda: (
            judge_group(judge, cfg.rollout.name, GpuPool.of(cfg.trainer), cfg.rollout.gpu_memory_utilization)
            if use_ray
            else local_group(RolloutWorker, engine_threads(1), engine=cfg.rollout.name)
        ),
        RolloutWorker.generate,
        rollouts,
        lambda shard: (judge.model_path, shard, spec),
        columns=READ_COLUMNS,
        sink=sink,
        finish=finish,
        prepare=JudgeInputs(judge.model_path, judge.prompt_template, prompts),
    )


def combine_judge_scores(scored: pd.DataFrame, judgements: pd.DataFrame, combine: str) -> pd.DataFrame:
    """scored_rollouts rows plus judge_score and judge_error; reward = judge_score + overlong_penalty (replace)
    or reward + judge_score (add); an unparsed verdict adds nothing (replace: 0 + overlong_penalty)."""
    j = judgements.set_index("rollout_id").loc[scored["rollout_id"], ["judge_score", "judge_error"]]
    judged = j["judge_score"].to_numpy(dtype=np.float64)
    contribution = np.nan_to_num(judged, nan=0.0)
    if combine == "replace":
        reward = contribution + scored["overlong_penalty"].to_numpy(dtype=np.float64)
    elif combine == "add":
        reward = scored["reward"].to_numpy(dtype=np.float64) + contribution
    else:
        raise ValueError(f"reward.judge.combine must be 'replace' or 'add', got {combine!r}")
    return scored.assign(reward=reward, judge_score=judged, judge_error=j["judge_error"].to_numpy())
