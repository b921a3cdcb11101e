"""Policy losses: aggregation numbers, PPO clip / dual-clip bounds and grads, GSPO, masking."""

from __future__ import annotations

import math

import pytest
import torch

from stages.algos.losses import (
    LOSS_AGG_MODES,
    POLICY_LOSS_FNS,
    GlobalBatch,
    aggregate_loss,
    compute_policy_loss,
    compute_policy_loss_gspo,
    entropy_from_logits,
    gather_logprobs,
    get_policy_loss_fn,
)

T = torch.tensor
E = math.e

# loss_mat [[1,2,3],[4,5,6]], mask [[1,1,0],[1,0,0]]; counted: row 0 {1,2}, row 1 {4}.
#   token-mean              (1+2+4)/3           = 7/3
#   seq-mean-token-sum      ((1+2) + 4)/2        = 3.5
#   seq-mean-token-mean     ((1+2)/2 + 4/1)/2    = 2.75
#   seq-mean-token-sum-norm (3 + 4)/(N=2 * L=3)  = 7/6; with norm_length 7: 7/14 = 0.5
AGG_GOLDEN = {
    "token-mean": 7 / 3,
    "seq-mean-token-sum": 3.5,
    "seq-mean-token-mean": 2.75,
    "seq-mean-token-sum-norm": 7 / 6,
}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregate_loss_golden(mode):
    loss_mat, mask = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert float(aggregate_loss(loss_mat, mask, mode)) == pytest.approx(AGG_GOLDEN[mode])


def test_seq_mean_modes_count_fully_masked_rows_as_verls_trainer():
    # the golden batch plus a third row with no counted token (empty response, or rejected by rollout_rs):
    # verl's trainer divides by global_batch_size = ppo_mini_batch_size x rollout.n = 3 rows, empty one included
    #   seq-mean-token-sum      (3 + 4 + 0)/3        = 7/3   (2/3 of the 3.5 over the 2 non-empty rows)
    #   seq-mean-token-mean     (1.5 + 4 + 0)/3      = 11/6  (2/3 of 2.75)
    #   seq-mean-token-sum-norm (3 + 4 + 0)/(3 * 3)  = 7/9   (2/3 of 7/6)
    #   token-mean              (1+2+4)/3 tokens     = 7/3   (rows do not enter)
    loss_mat = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    want = {"seq-mean-token-sum": 7 / 3, "seq-mean-token-mean": 11 / 6, "seq-mean-token-sum-norm": 7 / 9}
    for mode, value in want.items():
        assert float(aggregate_loss(loss_mat, mask, mode)) == pytest.approx(value), mode
        # the factor: with the 2 non-empty rows as the mini-batch size, the golden numbers above
        two = GlobalBatch(num_tokens=3.0, num_seqs=2.0)
        assert float(aggregate_loss(loss_mat, mask, mode, global_batch=two)) == pytest.approx(value * 3 / 2), mode
    assert float(aggregate_loss(loss_mat, mask, "token-mean")) == pytest.approx(7 / 3)


def test_aggregate_loss_norm_length_and_bad_mode():
    loss_mat, mask = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert float(aggregate_loss(loss_mat, mask, "seq-mean-token-sum-norm", norm_length=7)) == 0.5
    with pytest.raises(ValueError, match=r"Unknown loss_agg_mode 'mean'.*token-mean"):
        aggregate_loss(loss_mat, mask, "mean")


# One token per case, old log-prob 0, clip 0.2/0.2 unless given, clip_ratio_c 3.
# (advantage, log-ratio, expected loss, expected d loss / d logprob), derivations:
PPO_CASES = [
    # A=+1, ratio e: unclipped -e, clipped -1.2, max -> -1.2; clipped side -> grad 0.
    (1.0, 1.0, -1.2, 0.0),
    # A=+1, ratio 1.1 inside the band: loss -1.1, grad -A*ratio = -1.1.
    (1.0, math.log(1.1), -1.1, -1.1),
    # A=+1, ratio 0.5 below 1-0.2: unclipped -0.5 > clipped -0.8 -> -0.5, grad -0.5 (no clip).
    (1.0, math.log(0.5), -0.5, -0.5),
    # A=-1, ratio 0.5: unclipped 0.5 < clipped 0.8 -> 0.8 (clipped side), grad 0.
    (-1.0, math.log(0.5), 0.8, 0.0),
    # A=-1, ratio e: PPO max(e, 1.2) = e; dual min(e, -A*c = 3) = e; grad -A*ratio = e.
    (-1.0, 1.0, E, E),
    # A=-1, ratio e^2 = 7.389: PPO 7.389, dual clip min(7.389, 3) = 3, grad 0.
    (-1.0, 2.0, 3.0, 0.0),
]


@pytest.mark.parametrize("adv,log_ratio,loss_expected,grad_expected", PPO_CASES)
def test_ppo_clip_and_dual_clip_golden(adv, log_ratio, loss_expected, grad_expected):
    logprobs = T([[log_ratio]], requires_grad=True)
    loss, m = compute_policy_loss(torch.zeros(1, 1), logprobs, T([[adv]]), torch.ones(1, 1))
    loss.backward()
    assert float(loss.detach()) == pytest.approx(loss_expected, rel=1e-5)
    assert float(logprobs.grad) == pytest.approx(grad_expected, abs=1e-6, rel=1e-5)
    assert m["actor/pg_loss"] == pytest.approx(loss_expected, rel=1e-5)
    assert m["actor/ppo_kl"] == pytest.approx(-log_ratio, rel=1e-5)


def test_ppo_clipfrac_metrics():
    # tokens: (A=1, ratio e) clipped; (A=-1, ratio e^2) dual-clipped (also PPO-unclipped side);
    # (A=1, ratio 1) neither. pg_clipfrac = 1/3, pg_clipfrac_lower = 1/3.
    logprobs = T([[1.0, 2.0, 0.0]])
    _, m = compute_policy_loss(torch.zeros(1, 3), logprobs, T([[1.0, -1.0, 1.0]]), torch.ones(1, 3))
    assert m["actor/pg_clipfrac"] == pytest.approx(1 / 3)
    assert m["actor/pg_clipfrac_lower"] == pytest.approx(1 / 3)


def test_clip_higher_bounds():
    # clip_ratio_high 0.28: ratio e^0.2 = 1.2214 is inside [0.8, 1.28] -> loss -1.2214, grad
    # -1.2214 (with the symmetric 0.2 it would clip at 1.2); ratio e^0.25 = 1.2840 -> -1.28, grad 0.
    for lr, loss_e, grad_e in [(0.2, -math.exp(0.2), -math.exp(0.2)), (0.25, -1.28, 0.0)]:
        logprobs = T([[lr]], requires_grad=True)
        loss, _ = compute_policy_loss(torch.zeros(1, 1), logprobs, T([[1.0]]), torch.ones(1, 1), clip_ratio_high=0.28)
        loss.backward()
        assert float(loss.detach()) == pytest.approx(loss_e, rel=1e-5)
        assert float(logprobs.grad) == pytest.approx(grad_e, abs=1e-6, rel=1e-5)


def test_ppo_rejects_bad_clip_ratio_c():
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        compute_policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), clip_ratio_c=1.0)


def test_gspo_golden_clipped():
    # log-ratios [0.2, 0.4] -> sequence log-ratio 0.3, s = e^0.3 = 1.349859; A = +1, bounds 0.2:
    # clipped at 1.2 on both tokens -> loss -1.2 (seq-mean-token-mean), grad 0.
    logprobs = T([[0.2, 0.4]], requires_grad=True)
    loss, m = compute_policy_loss_gspo(
        torch.zeros(1, 2), logprobs, torch.ones(1, 2), torch.ones(1, 2), clip_ratio_low=0.2, clip_ratio_high=0.2
    )
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-1.2)
    assert torch.equal(logprobs.grad, torch.zeros(1, 2))
    assert m["actor/pg_clipfrac"] == 1.0 and m["actor/pg_clipfrac_lower"] == 0.0


def test_gspo_unclipped_matches_sequence_objective():
    # A = -1: unclipped s = 1.349859 > clipped 1.2 -> loss = s; d/dlogp_t = -A * s / |y|
    # = 1.349859 / 2 = 0.674929, the gradient of GSPO's sequence loss -A * s(theta).
    s = math.exp(0.3)
    logprobs = T([[0.2, 0.4]], requires_grad=True)
    loss, _ = compute_policy_loss_gspo(
        torch.zeros(1, 2), logprobs, -torch.ones(1, 2), torch.ones(1, 2), clip_ratio_low=0.2, clip_ratio_high=0.2
    )
    loss.backward()
    assert float(loss.detach()) == pytest.approx(s, rel=1e-6)
    torch.testing.assert_close(logprobs.grad, T([[s / 2, s / 2]]))
    direct = T([[0.2, 0.4]], requires_grad=True)
    (1.0 * torch.exp(direct.mean())).backward()  # -A * s with A = -1
    torch.testing.assert_close(logprobs.grad, direct.grad)


def _random_inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(3, 5, generator=g)
    new = old + 0.5 * torch.randn(3, 5, generator=g)
    adv = torch.randn(3, 5, generator=g)
    mask = T([[1.0, 1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    return old, new, adv, mask


@pytest.mark.parametrize("loss_name", sorted(POLICY_LOSS_FNS))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_masked_tokens_change_nothing(loss_name, mode):
    fn = get_policy_loss_fn(loss_name)
    old, new, adv, mask = _random_inputs(0)
    off = mask == 0
    results = []
    for o, n, a in [
        (old, new, adv),
        (old.masked_fill(off, -9.0), new.masked_fill(off, 3.0), adv.masked_fill(off, 50.0)),
    ]:
        logprobs = n.clone().requires_grad_(True)
        loss, _ = fn(o, logprobs, a, mask, clip_ratio_low=0.2, clip_ratio_high=0.2, loss_agg_mode=mode)
        loss.backward()
        results.append((loss.detach(), logprobs.grad))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])
    assert (results[0][1][off] == 0).all()


def test_fully_masked_row_adds_nothing_to_token_mean():
    old, new, adv, mask = _random_inputs(1)
    full, _ = compute_policy_loss(old, new, adv, mask)
    part, _ = compute_policy_loss(old[:2], new[:2], adv[:2], mask[:2])
    torch.testing.assert_close(full, part)


def test_policy_loss_registry():
    assert get_policy_loss_fn("vanilla") is compute_policy_loss
    assert get_policy_loss_fn("gspo") is compute_policy_loss_gspo
    with pytest.raises(ValueError, match=r"Unknown policy loss 'ppo'.*'gspo', 'vanilla'"):
        get_policy_loss_fn("ppo")


def test_entropy_and_gather_uniform():
    # uniform over V = 4: entropy ln 4 = 1.386294, every token's log-prob -ln 4.
    logits = torch.zeros(2, 3, 4)
    torch.testing.assert_close(entropy_from_logits(logits), torch.full((2, 3), math.log(4)))
    torch.testing.assert_close(
        gather_logprobs(logits, torch.zeros(2, 3, dtype=torch.long)), torch.full((2, 3), -math.log(4))
    )
