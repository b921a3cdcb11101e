"""Multi-turn response masks (issue #21): observation tokens (response_mask 0) stay in the context but get no
advantage, loss, KL, entropy or value loss, and do not count in the loss normalisation. No Ray."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from configs.schema import ActorConfig, AlgorithmConfig, CriticConfig, OptimConfig
from stages.advantage_table import compute_advantage_table
from stages.algos.advantages import outcome_to_token_rewards
from stages.io.store import to_arrow
from stages.models.policy import load_policy
from stages.old_logprobs import probs_gap
from stages.train.actor import ppo_update
from stages.train.batching import actor_batch, pad_rollouts, row_masks
from stages.train.critic import critic_data_metrics, update_rows
from stages.train.optim import make_optimizer
from stages.train.ppo_loop import actor_loss, critic_loss

sys.path.insert(0, str(Path(__file__).parent))
from helpers_rollouts import scored_rows

GARBAGE = 1e6


def test_pad_rollouts_masks_observation_tokens_but_keeps_them_as_context() -> None:
    b = pad_rollouts([[1, 2], [3]], [[4, 5, 6], [7, 8]], pad_id=0, masks=[[1, 0, 1], None])
    # P = 2, L = 3; prompts left-padded, responses right-padded; row 1's None mask = all ones
    assert b["input_ids"].tolist() == [[1, 2, 4, 5, 6], [0, 3, 7, 8, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 1, 0]]  # token 5 still attended to
    assert b["response_mask"].tolist() == [[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]]
    with pytest.raises(ValueError, match=r"row 0: response_mask .* one 0 or 1 per response token \(3\)"):
        pad_rollouts([[1]], [[4, 5, 6]], 0, masks=[[1, 0]])


def test_row_masks_reads_missing_and_null_columns_as_all_ones() -> None:
    assert row_masks(None) is None
    assert row_masks(pd.Series([None, float("nan")], dtype=object)) is None  # single-turn: the fast path
    assert row_masks(pd.Series([None, [1, 0]], dtype=object)) == [None, [1, 0]]


def test_outcome_reward_sits_on_the_last_model_token() -> None:
    # row 0 ends with an observation (cut at max length after a tool answer): its last model token is index 1
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 1.0]])
    assert outcome_to_token_rewards(torch.tensor([2.0, 3.0]), mask).tolist() == [[0, 2, 0, 0], [0, 0, 0, 3]]


def test_grpo_advantages_are_zero_on_observation_tokens_and_the_table_keeps_the_mask() -> None:
    masks = [[1, 0, 1], None, [1, 1], [1, 0, 0, 1]]
    out = compute_advantage_table(scored_rows([1, 0, 0, 1], [3, 3, 2, 4], masks), AlgorithmConfig())
    # group rewards [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3) -> +-0.866025 on every MODEL token
    a = 0.866025
    want = [[a, 0, a], [-a, -a, -a], [-a, -a], [a, 0, 0, a]]
    for got, w in zip(out["token_advantages"], want, strict=True):
        assert list(got) == pytest.approx(w, abs=1e-5)
    assert out["response_mask"].tolist() == masks
    assert to_arrow("advantages", out.assign(run_id="r", iteration=0)).column("response_mask").to_pylist() == masks
    single = compute_advantage_table(scored_rows([1, 0, 0, 1], [3, 3, 2, 4], [None] * 4), AlgorithmConfig())
    table = to_arrow("advantages", single.assign(run_id="r", iteration=0))
    assert table.column("response_mask").null_count == 4  # single-turn runs write null


def test_gae_skips_the_observation_tokens_hand_derived() -> None:
    # one rollout, 4 tokens, mask [1, 0, 1, 0] (model, observation, model, observation at the end),
    # values [0.5, 9, 0.2, 7] (9 and 7 on observation tokens: must not matter), reward 1, gamma 1, lam 0.5.
    # The reward sits on token 2 (the last MODEL token). Right to left, skipping masked tokens:
    #   t3 skipped; t2: delta = 1 + 1 * 0 (episode end) - 0.2 = 0.8, A2 = 0.8
    #   t1 skipped; t0: delta = 0 + 1 * V2 (the next MODEL token's value, 0.2) - 0.5 = -0.3,
    #                   A0 = -0.3 + 1 * 0.5 * A2 = 0.1
    # returns = A + V on model tokens: [0.6, 0, 1.0, 0]. (Without skipping the hole: A1 = 0 + 0.2 - 9 + 0.4
    # = -8.4, A0 = 8.5 + 0.5 * -8.4 = 4.3, R0 = 4.8.)
    # Whitened over the 2 counted tokens [0.1, 0.8]: mean 0.45, unbiased std sqrt(0.245) = 0.494975
    #   -> [-0.35 / 0.494975, 0.35 / 0.494975] = [-0.707107, 0.707107]
    scored = scored_rows([1.0], [4], [[1, 0, 1, 0]])
    values = pd.DataFrame({"rollout_id": [0], "values": [[0.5, 9.0, 0.2, 7.0]]})
    out = compute_advantage_table(scored, AlgorithmConfig(adv_estimator="gae", gamma=1.0, lam=0.5), values=values)
    assert list(out["returns"].iloc[0]) == pytest.approx([0.6, 0.0, 1.0, 0.0], abs=1e-6)
    assert list(out["token_advantages"].iloc[0]) == pytest.approx([-0.707107, 0.0, 0.707107, 0.0], abs=1e-5)


def test_kl_in_reward_counts_model_tokens_only() -> None:
    scored = scored_rows([0.0], [3], [[1, 0, 1]]).assign(rollout_logprobs=[[-1.0, 0.0, -1.0]])
    ref = pd.DataFrame({"rollout_id": [0], "ref_logprobs": [[-1.5, -GARBAGE, -2.0]]})
    old = pd.DataFrame(
        {
            "rollout_id": [0],
            "old_logprobs": [[-1.0, -3.0, -1.0]],
            "rollout_probs_diff_max": [0.0],
            "rollout_probs_diff_mean": [0.0],
        }
    )
    cfg = AlgorithmConfig(use_kl_in_reward=True, kl_penalty="kl")
    out = compute_advantage_table(scored, cfg, ref=ref, kl_coef=0.1, old=old)
    # k1 = old - ref on model tokens: 0.5 and 1.0 -> token mean 0.75 (the observation token is left out)
    assert out["reward_kl"].iloc[0] == pytest.approx(0.75)


def _loss_batch(rows: dict, use_kl_loss: bool = True) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(loss, d loss / d logits, metrics) of actor_loss on actor_batch(rows) with fixed random logits."""
    batch = actor_batch(rows, pad_id=0, use_kl_loss=use_kl_loss)
    n, width = batch["responses"].shape
    logits = torch.randn(n, width, 11, generator=torch.Generator().manual_seed(0)).requires_grad_()
    cfg = ActorConfig(use_kl_loss=use_kl_loss, kl_loss_coef=0.1, entropy_coeff=0.01, loss_agg_mode="token-mean")
    loss, metrics = actor_loss(logits, batch, cfg)
    loss.backward()
    return loss.detach(), logits.grad, metrics


def _rows(hole: float) -> dict:
    """2 rollouts with observation tokens (mask 0) holding `hole` in every per-token input."""
    return {
        "prompt_token_ids": [[1, 2], [3]],
        "response_token_ids": [[4, 5, 6, 7], [8, 9]],
        "response_mask": [[1, 0, 0, 1], [1, 0]],
        "advantages": torch.tensor([1.0, -1.0]),
        "token_advantages": [[1.0, hole, hole, 2.0], [-1.0, hole]],
        "old_logprobs": [[-2.0, -hole, -hole, -2.5], [-2.2, -hole]],
        "ref_logprobs": [[-2.1, hole, -hole, -2.4], [-2.0, hole]],
    }


def test_observation_tokens_have_no_effect_on_the_actor_loss_or_gradients() -> None:
    loss, grad, metrics = _loss_batch(_rows(GARBAGE))
    loss0, grad0, metrics0 = _loss_batch(_rows(0.0))
    assert torch.isfinite(loss) and torch.equal(loss, loss0) and torch.equal(grad, grad0)
    assert metrics == metrics0
    assert (grad[0, 1:3] == 0).all() and (grad[1, 1] == 0).all()  # no gradient reaches an observation token
    no_mask = {k: v for k, v in _rows(0.0).items() if k != "response_mask"}
    assert not torch.equal(_loss_batch(no_mask)[0], loss0)  # the mask is what makes them not count


def test_token_mean_counts_model_tokens_only() -> None:
    rows = _rows(GARBAGE)
    batch = actor_batch(rows, pad_id=0, use_kl_loss=False)
    n, width = batch["responses"].shape
    logits = torch.randn(n, width, 11, generator=torch.Generator().manual_seed(1))
    logp = torch.log_softmax(logits, -1).gather(-1, batch["responses"][..., None])[..., 0]  # (N, L)
    batch["old_logprobs"] = logp  # ratio 1 on every token: the loss of a token is -advantage
    cfg = ActorConfig(loss_agg_mode="token-mean", entropy_coeff=0.0)
    loss, _ = actor_loss(logits, batch, cfg)
    # model tokens' advantages 1, 2 (row 0) and -1 (row 1): -(1 + 2 - 1) / 3 model tokens (not / 6 tokens)
    assert float(loss) == pytest.approx(-2.0 / 3.0, abs=1e-6)


def test_a_policy_update_ignores_what_observation_tokens_carry(tiny_checkpoint) -> None:
    actor = ActorConfig(ppo_mini_batch_size=1, ppo_micro_batch_size=2, optim=OptimConfig(lr=1e-3))
    params = []
    for hole in (GARBAGE, 0.0):
        torch.manual_seed(0)
        model, tok = load_policy(tiny_checkpoint)
        opt, sched = make_optimizer(model, actor.optim)
        rows = {**_rows(hole), "prompt_token_ids": [[10, 11], [12]], "response_token_ids": [[13, 14, 15, 16], [17, 18]]}
        m = ppo_update(model, opt, sched, rows, actor, n_per_prompt=2, pad_id=tok.pad_token_id)
        assert all(torch.isfinite(torch.tensor(v)) for v in m.values()), m
        params.append(model.state_dict())
    assert all(torch.equal(params[0][k], params[1][k]) for k in params[0])


def test_critic_value_loss_and_metrics_skip_observation_tokens() -> None:
    advantages = pd.DataFrame(
        {
            "rollout_id": [0, 1],
            "prompt_token_ids": [[1, 2], [3]],
            "response_token_ids": [[4, 5, 6], [7, 8]],
            "response_mask": pd.Series([[1, 0, 1], None], dtype=object),
            "token_advantages": [[0.5, 0.0, -0.5], [1.0, -1.0]],
            "returns": [[1.0, 0.0, 2.0], [3.0, 4.0]],
        }
    )
    values = pd.DataFrame({"rollout_id": [1, 0], "values": [[3.0, 4.0], [1.0, GARBAGE, 2.0]]})
    rows = update_rows(advantages, values)
    assert rows["response_mask"] == [[1, 0, 1], None]
    m = critic_data_metrics(advantages, values)
    assert m["critic/values/max"] == 4.0 and m["critic/vf_explained_var"] == pytest.approx(1.0, abs=1e-4)
    batch = pad_rollouts(rows["prompt_token_ids"], rows["response_token_ids"], 0, rows["response_mask"])
    batch["old_values"] = torch.tensor([[1.0, 0.0, 2.0], [3.0, 4.0, 0.0]])
    batch["returns"] = batch["old_values"] + 1.0
    vpreds = batch["old_values"].clone()
    vpreds[0, 1] = GARBAGE  # the critic's prediction on an observation token
    loss, _ = critic_loss(vpreds, batch, CriticConfig(loss_agg_mode="token-mean"))
    # 0.5 * (vpred - return)^2 = 0.5 on each of the 4 model tokens (verl's 0.5 factor), token-mean: 0.5
    assert float(loss) == pytest.approx(0.5)


def test_probs_diff_skips_observation_tokens() -> None:
    # the engine's rollout_logprobs are 0.0 placeholders on observation tokens (probability 1)
    old = [[-1.0, -5.0, -2.0], [-1.0]]
    engine = [[-1.0, 0.0, -2.0 + 0.1], [-1.0]]
    metrics, row_max, row_mean = probs_gap(old, engine, [[1, 0, 1], None])
    gap = abs(torch.tensor(-2.0).exp() - torch.tensor(-1.9).exp()).item()  # the one model token that differs
    assert row_max.tolist() == pytest.approx([gap, 0.0]) and row_mean.tolist() == pytest.approx([gap / 2, 0.0])
    assert metrics["training/rollout_probs_diff_max"] == pytest.approx(gap)
    assert probs_gap(old, engine)[1][0] > 0.99  # without the mask the placeholder dominates: |e^-5 - 1|


def test_iteration_metrics_count_model_tokens_apart() -> None:
    from stages.iteration_metrics import probs_diff_metrics, rollout_metrics

    scored = scored_rows([1.0, 0.0], [3, 2], [[1, 0, 1], None]).assign(
        finish_reason="stop", rollout_logprobs=[[-1.0, 0.0, -1.0], [-1.0, -1.0]]
    )
    adv = compute_advantage_table(scored, AlgorithmConfig()).assign(old_logprobs=[[-1.0, -7.0, -1.0], [-1.0, -1.0]])
    m = rollout_metrics(scored, adv, max_response_length=8)
    assert m["response_length/mean"] == 2.5 and m["response_length/model_tokens_mean"] == 2.0  # (2 + 2) / 2
    assert probs_diff_metrics(scored, adv)["training/rollout_probs_diff_max"] == 0.0  # the placeholder is left out
    assert "response_length/model_tokens_mean" not in rollout_metrics(scored.drop(columns="response_mask"), adv, 8)
