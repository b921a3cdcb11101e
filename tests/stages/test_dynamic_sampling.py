"""DAPO in the pipeline: candidate prompt rounds, the group filter, generation until the batch is full
(real tiny model, real reward stage), and overlong reward shaping in the reward stage."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from configs.schema import FilterGroupsConfig, RewardConfig, RolloutConfig, load_config
from stages.filter_groups import filter_metric, generate_until_full, kept_group_ids, select_training_groups
from stages.prompt_batches import iteration_prompts, prompt_rounds
from stages.scored_rollouts import score_rollouts


def test_prompt_rounds_are_deterministic_disjoint_and_capped() -> None:
    first = [(3, 0, 10), (7, 0, 11)]
    rounds = prompt_rounds(list(range(20)), first, 5, gen_batch_size=2, max_rounds=3, seed=0)
    assert [r for *_, r in rounds] == [0, 0, 1, 1, 2, 2]
    assert rounds[:2] == [(3, 0, 10, 0), (7, 0, 11, 0)]  # round 0 is the epoch cursor's
    ids = [p for p, *_ in rounds]
    assert len(set(ids)) == 6 and [pos for _, _, pos, _ in rounds[2:]] == [-1, -2, -3, -4]
    assert rounds == prompt_rounds(list(range(20)), first, 5, gen_batch_size=2, max_rounds=3, seed=0)
    assert prompt_rounds(list(range(20)), first, 6, gen_batch_size=2, max_rounds=3, seed=0)[2:] != rounds[2:]
    # no cap: every full round of the 18 other prompts -> 1 + 9 rounds
    assert max(r for *_, r in prompt_rounds(list(range(20)), first, 5, gen_batch_size=2, max_rounds=0, seed=0)) == 9


def test_iteration_prompts_use_gen_batch_size_only_with_filter_groups() -> None:
    plain = load_config("configs/ci_tiny.yaml")
    assert [r for *_, r in iteration_prompts(list(range(50)), 0, plain)] == [0] * 8
    dapo = load_config(
        "configs/ci_tiny.yaml",
        [
            "algorithm.filter_groups.enable=true",
            "data.gen_batch_size=10",
            "algorithm.filter_groups.max_num_gen_batches=3",
        ],
    )
    picks = iteration_prompts(list(range(50)), 0, dapo)
    assert [sum(1 for *_, r in picks if r == k) for k in range(3)] == [10, 10, 10] and len(picks) == 30


def _scored(values: list[float], group_size: int = 2) -> pd.DataFrame:
    n = len(values)
    return pd.DataFrame(
        {
            "rollout_id": range(n),
            "group_id": [10 + i // group_size for i in range(n)],
            "score": values,
            "reward": [v - 0.1 * (i % 2) for i, v in enumerate(values)],
        }
    )


def test_filter_metric_and_kept_groups() -> None:
    scored = _scored([1.0, 1.0, 0.0, 1.0, 0.1, 0.0, 0.0, 0.0])
    assert filter_metric(scored, "acc", 1.0).tolist() == [1, 1, 0, 1, 0, 0, 0, 0]
    assert kept_group_ids(scored, "acc", 1.0) == [11]  # 0.1 (format only) counts as wrong under acc
    assert kept_group_ids(scored, "score", 1.0) == [11, 12]
    assert kept_group_ids(scored, "seq_reward", 1.0) == [10, 11, 12, 13]  # the shaped reward differs in every group
    with pytest.raises(ValueError, match="Valid: \\['acc', 'score', 'seq_reward'\\]"):
        filter_metric(scored, "entropy", 1.0)


def test_select_training_groups_keeps_the_first_passing_groups() -> None:
    scored = _scored([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    cfg = FilterGroupsConfig(enable=True, metric="score")
    kept = select_training_groups(scored, cfg, need_groups=2, correct_score=1.0)
    assert kept["group_id"].tolist() == [10, 10, 12, 12]
    assert select_training_groups(scored, FilterGroupsConfig(), need_groups=2, correct_score=1.0) is scored
    with pytest.raises(ValueError, match="only 3 groups .* fewer than data.train_batch_size \\(4\\)"):
        select_training_groups(scored, cfg, need_groups=4, correct_score=1.0)


def _prompt_rounds_frame(tok, rounds: int, per_round: int) -> pd.DataFrame:
    from stages.models.policy import encode_chat

    rows = []
    for r in range(rounds):
        for j in range(per_round):
            pid = r * per_round + j
            rows.append(
                {
                    "prompt_id": pid,
                    "prompt_token_ids": encode_chat(tok, [{"role": "user", "content": f"{pid}+1="}])[0],
                    "data_source": "rlake/arith",
                    "ground_truth": str(pid + 1),
                    "prompt_text": f"{pid}+1=",
                    "group_id": pid if r == 0 else -1 - pid,
                    "policy_version": 0,
                    "gen_round": r,
                }
            )
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def eos_prone_checkpoint(tmp_path_factory) -> str:
    """A random tiny Qwen2 whose EOS logit is scaled up, so sampled responses end at varied lengths."""
    import torch

    from configs.schema import TinyModelConfig
    from stages.models.policy import save_policy
    from stages.models.tiny import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(hidden_size=64, intermediate_size=128), len(tok), seed=0)
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= 30.0
    return save_policy(model, tok, tmp_path_factory.mktemp("eos_prone") / "policy_v0")


def test_generate_until_full_with_the_real_engine(eos_prone_checkpoint) -> None:
    """Shaped rewards (overlong penalty on lengths) give some groups spread: rounds stop once enough pass;
    an unreachable target is a clear error after every round was generated."""
    from stages.models.policy import load_policy
    from stages.rollouts import generate_shards
    from stages.workers.sharded import shard_frames

    tiny_checkpoint = eos_prone_checkpoint
    _, tok = load_policy(tiny_checkpoint)
    batch = _prompt_rounds_frame(tok, rounds=4, per_round=3)
    rollout_cfg = RolloutConfig(name="hf", n=3)
    reward_cfg = RewardConfig(overlong_buffer={"enable": True, "len": 5, "penalty_factor": 1.0})
    generated = []

    def generate(prompts: pd.DataFrame, r: int, first_id: int) -> list:
        generated.append(r)
        return generate_shards(
            prompts,
            model_dir=str(tiny_checkpoint),
            rollout_cfg=rollout_cfg,
            max_tokens=6,
            seed=r,
            use_ray=False,
            first_id=first_id,
            stamp={"gen_round": r},
        )

    def score(results: list) -> pd.DataFrame:
        return score_rollouts(shard_frames(results), reward_cfg, use_ray=False, max_response_length=6)

    passes = generate_until_full(batch, generate, score, metric="seq_reward", correct_score=1.0, need_groups=4)
    out = shard_frames([r for p in passes for r in p])
    assert out["rollout_id"].tolist() == list(range(len(out))) and len(out) == 9 * len(generated)
    assert sorted(out["gen_round"].unique()) == generated == list(range(len(generated)))
    per_round = [len(kept_group_ids(score(p), "seq_reward", 1.0)) for p in passes]
    assert sum(per_round) >= 4 and sum(per_round[:-1]) < 4  # stopped at the first round that filled the batch
    assert out.groupby("group_id")["gen_round"].nunique().max() == 1
    generated.clear()
    with pytest.raises(ValueError, match="dynamic sampling kept 0 groups after 4 generation rounds"):
        generate_until_full(
            batch, generate, score, metric="acc", correct_score=1.0, need_groups=1
        )  # untrained: all wrong
    assert generated == [0, 1, 2, 3]


def test_overlong_shaping_in_the_reward_stage() -> None:
    rollouts = pd.DataFrame(
        {
            "rollout_id": range(4),
            "data_source": "rlake/arith",
            "ground_truth": "7",
            "response_text": ["#### 7", "#### 7", "#### 3", "#### 7"],
            "response_length": [4, 6, 7, 8],
        }
    )
    cfg = RewardConfig(format_score=0.1, overlong_buffer={"enable": True, "len": 4, "penalty_factor": 0.5})
    out = score_rollouts(rollouts, cfg, use_ray=False, max_response_length=8)
    # L_max 8, L_cache 4: free up to 4 tokens; then (4 - |y|) / 4 * 0.5 -> 6: -0.25, 7: -0.375, 8: -0.5
    assert out["overlong_penalty"].tolist() == pytest.approx([0.0, -0.25, -0.375, -0.5])
    assert out["score"].tolist() == [1.0, 1.0, 0.1, 1.0]
    assert out["reward"].tolist() == pytest.approx([1.0, 0.75, -0.275, 0.5])
    unshaped = score_rollouts(rollouts, cfg, use_ray=False)  # validation: no generation limit given
    assert unshaped["reward"].tolist() == unshaped["score"].tolist() == [1.0, 1.0, 0.1, 1.0]
    off = score_rollouts(rollouts, RewardConfig(format_score=0.1), use_ray=False, max_response_length=8)
    assert np.all(off["overlong_penalty"].to_numpy() == 0.0)


def test_dapo_config_errors_say_what_and_how() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="data.gen_batch_size \\(16\\) must be >= data.train_batch_size"):
        load_config("configs/ci_tiny.yaml", ["data.gen_batch_size=16"])
    with pytest.raises(
        ValidationError, match="overlong_buffer.len \\(9\\) must be in \\(0, data.max_response_length=8\\]"
    ):
        load_config("configs/ci_tiny.yaml", ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=9"])


def test_algorithm_metrics_from_stored_columns() -> None:
    from stages.iteration_metrics import algorithm_metrics

    scored = pd.DataFrame(
        {
            "group_id": [1, 1, 2, 2, -1, -1],
            "gen_round": [0, 0, 0, 0, 1, 1],
            "overlong_penalty": [0.0, -0.5, 0.0, 0.0, -1.0, 0.0],
        }
    )
    adv = pd.DataFrame({"group_id": [1, 1, -1, -1], "kl_coef": [0.01] * 4, "reward_kl": [0.1, 0.3, 0.0, 0.2]})
    m = algorithm_metrics(scored, adv)
    assert m["train/num_gen_batches"] == 2 and m["train/num_groups_generated"] == 3 and m["train/num_groups_kept"] == 2
    assert m["actor/reward_kl_penalty"] == pytest.approx(0.15) and m["actor/reward_kl_penalty_coeff"] == 0.01
    assert m["reward/overlong_penalty/mean"] == pytest.approx(-0.25) and m[
        "reward/overlong_penalized_frac"
    ] == pytest.approx(1 / 3)
    no_kl = algorithm_metrics(scored.drop(columns=["gen_round"]), adv.assign(kl_coef=np.nan))
    assert "actor/reward_kl_penalty" not in no_kl and "train/num_gen_batches" not in no_kl
    assert "actor/teacher_kl" not in no_kl  # only with on-policy distillation:
    distilled = algorithm_metrics(scored, adv.assign(teacher_kl=[0.5, 1.5, 2.0, 0.0]))
    assert distilled["actor/teacher_kl"] == pytest.approx(1.0)  # (0.5 + 1.5 + 2.0 + 0.0) / 4 rollouts
