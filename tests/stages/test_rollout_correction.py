"""algorithm.rollout_correction end to end without Ray: the config's checks, the advantages table's
rollout_logprobs column, the padded batch, and the torch update (off = unchanged; weights of exactly 1 =
unchanged; rejecting every token = no step; the rollout_corr/ metrics reach the update's metrics)."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from pydantic import ValidationError

from configs.schema import ActorConfig, AlgorithmConfig, OptimConfig, RolloutCorrectionConfig, load_config
from stages.advantage_table import compute_advantage_table
from stages.models.policy import load_policy
from stages.train.actor import compute_logprobs, ppo_update
from stages.train.batching import actor_batch
from stages.train.optim import make_optimizer

sys.path.insert(0, str(Path(__file__).parent))
from helpers_rollouts import as_trainer_rows, make_rows

KEY = "algorithm.rollout_correction"


def test_config_is_off_by_default_and_reads_verl_names() -> None:
    assert not AlgorithmConfig().rollout_correction.enabled
    cfg = load_config(
        None,
        [
            f"{KEY}.rollout_is=sequence",
            f"{KEY}.rollout_rs=token_k1,seq_max_k2",
            f"{KEY}.rollout_rs_threshold='0.5_2,0.1'",
        ],
    ).algorithm.rollout_correction
    assert cfg.enabled and cfg.is_bounds() == (None, 2.0)
    assert cfg.rs_bounds() == {"token_k1": (0.5, 2.0), "seq_max_k2": (None, 0.1)}
    assert RolloutCorrectionConfig(rollout_is_threshold="0.5_5.0").is_bounds() == (0.5, 5.0)  # IcePop
    assert RolloutCorrectionConfig(rollout_rs="seq_mean_k1", rollout_rs_threshold=2).rs_bounds() == {
        "seq_mean_k1": (0.5, 2.0)  # a k1 number is the upper ratio bound, lower = 1 / upper
    }


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"rollout_is_threshold": 0}, "must be > 0"),
        ({"rollout_is_threshold": "2_0.5"}, r"lower bound 2.0 > upper bound 0.5"),
        ({"rollout_is_threshold": "two"}, "is not a number"),
        ({"rollout_is_threshold": True}, "not a boolean"),
        ({"rollout_rs": "token_k1"}, "needs rollout_rs_threshold"),
        ({"rollout_rs": "seq_max_k1", "rollout_rs_threshold": 2}, r"unknown options \['seq_max_k1'\]"),
        ({"rollout_rs": "token_k2", "rollout_rs_threshold": "0.1_2"}, "must be one upper bound"),
        ({"rollout_rs": "token_k1,token_k2", "rollout_rs_threshold": "2,3,4"}, "one per option"),
        ({"rollout_rs": "token_k1", "rollout_rs_threshold": -1}, "must be > 0"),
        ({"rollout_rs": "seq_sum_k1", "rollout_rs_threshold": 0.5}, "must be >= 1: a single number is the upper"),
    ],
)
def test_config_errors_say_what_and_how(kw, match) -> None:
    with pytest.raises(ValidationError, match=match):
        RolloutCorrectionConfig(**kw)


def test_advantages_table_carries_the_engine_logprobs() -> None:
    scored = pd.DataFrame(
        {
            "rollout_id": [0, 1],
            "group_id": [0, 0],
            "policy_version": 0,
            "prompt_token_ids": [[5, 6], [5, 6]],
            "response_token_ids": [[7, 8], [7]],
            "response_length": [2, 1],
            "reward": [1.0, 0.0],
            "rollout_logprobs": [[-0.5, -1.5], [-2.0]],
        }
    )
    out = compute_advantage_table(scored, AlgorithmConfig())
    assert [list(x) for x in out["rollout_logprobs"]] == [[-0.5, -1.5], [-2.0]]
    no_col = compute_advantage_table(scored.drop(columns="rollout_logprobs"), AlgorithmConfig())
    assert [list(x) for x in no_col["rollout_logprobs"]] == [[], []]


def test_batch_pads_rollout_logprobs_only_when_on_and_checks_them() -> None:
    rows = as_trainer_rows(make_rows(4))
    assert "rollout_logprobs" not in actor_batch(rows, 0, use_kl_loss=False)
    with pytest.raises(ValueError, match="needs the engine's rollout_logprobs.*none"):
        actor_batch(rows, 0, use_kl_loss=False, rollout_logprobs=True)
    rows["rollout_logprobs"] = [[-1.0] * len(r) for r in rows["response_token_ids"]]
    batch = actor_batch(rows, 0, use_kl_loss=False, rollout_logprobs=True)
    assert torch.equal(batch["rollout_logprobs"], -batch["response_mask"])  # -1 on response tokens, 0 on padding
    rows["rollout_logprobs"][2] = [-1.0]
    with pytest.raises(ValueError, match=r"rows \[2\] have another length"):
        actor_batch(rows, 0, use_kl_loss=False, rollout_logprobs=True)


ACTOR = ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size=4, num_workers=1, optim=OptimConfig(lr=1e-3))


def _run(ckpt, rows: dict, correction) -> tuple[dict, dict[str, float]]:
    """(parameters after one ppo_update of 8 rollouts, its metrics)."""
    torch.manual_seed(0)
    model, tok = load_policy(ckpt)
    opt, sched = make_optimizer(model, ACTOR.optim)
    m = ppo_update(
        model, opt, sched, rows, ACTOR, n_per_prompt=4, pad_id=tok.pad_token_id, rollout_correction=correction
    )
    return {k: v.clone() for k, v in model.state_dict().items()}, m


def _own_logprobs(ckpt, rows: dict) -> list[list[float]]:
    """The policy's own log-probs of the responses, as ppo_update recomputes them (the same micro-batches)."""
    model, tok = load_policy(ckpt)
    model.eval()
    lp = compute_logprobs(model, actor_batch(rows, tok.pad_token_id, use_kl_loss=False), ACTOR.ppo_micro_batch_size)
    return [lp[i, : len(r)].tolist() for i, r in enumerate(rows["response_token_ids"])]


def test_update_off_on_with_unit_weights_and_all_rejected(tiny_checkpoint) -> None:
    rows = as_trainer_rows(make_rows(8))
    base_params, base = _run(tiny_checkpoint, rows, None)
    off_params, off = _run(tiny_checkpoint, rows, RolloutCorrectionConfig())
    assert off == base and all(torch.equal(off_params[k], v) for k, v in base_params.items())
    assert not any(k.startswith("rollout_corr/") for k in base)

    # the engine agrees with the trainer exactly: token weights exp(0) = 1, the same update bit for bit
    rows["rollout_logprobs"] = _own_logprobs(tiny_checkpoint, rows)
    tis_params, tis = _run(tiny_checkpoint, rows, RolloutCorrectionConfig(rollout_is="token"))
    assert all(torch.equal(tis_params[k], v) for k, v in base_params.items())
    assert tis["actor/pg_loss"] == base["actor/pg_loss"]
    assert tis["rollout_corr/rollout_is_mean"] == pytest.approx(1.0) and tis["rollout_corr/kl"] == 0.0

    # the engine's probabilities 10x the trainer's: token_k1 with bounds [0.5, 2] rejects every token, no step
    rows["rollout_logprobs"] = [[x + 2.302585 for x in r] for r in rows["rollout_logprobs"]]
    rs = RolloutCorrectionConfig(rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0")
    rs_params, rs_m = _run(tiny_checkpoint, rows, rs)
    assert rs_m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1.0)
    assert rs_m["actor/pg_loss"] == 0.0
    before, _ = load_policy(tiny_checkpoint)
    assert all(torch.equal(rs_params[k], v) for k, v in before.state_dict().items())


def test_config_and_algos_list_the_same_rejection_options() -> None:
    """configs/ may not import stages/algos (the lowest layer) and stages/algos imports torch/numpy only, so the
    option list is written in both: they must stay one list."""
    from configs.schema import ROLLOUT_RS_OPTIONS
    from stages.algos.rollout_is import RS_OPTIONS

    assert ROLLOUT_RS_OPTIONS == RS_OPTIONS
