"""The critic of PPO with GAE on a real tiny Qwen2: init from the policy, save/load, values, update."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from pydantic import ValidationError

from configs.schema import AlgorithmConfig, CriticConfig, OptimConfig, load_config
from stages.advantage_table import compute_advantage_table
from stages.algos.gae import compute_gae_advantages
from stages.algos.value import compute_value_loss
from stages.io.checkpoints import ModelStore
from stages.models.policy import load_policy
from stages.train.batching import pad_rollouts
from stages.train.critic import (
    OPTIMIZER_FILE,
    compute_values,
    critic_data_metrics,
    critic_update,
    init_critic,
    load_critic,
    ragged_to_padded,
    require_critic,
    response_values,
    run_critic_update,
    update_rows,
    values_frame,
)
from stages.train.optim import make_optimizer
from tests.stages.helpers_rollouts import make_rows


@pytest.fixture(scope="module")
def critic_v0(tiny_checkpoint, tmp_path_factory):
    return init_critic(tiny_checkpoint, tmp_path_factory.mktemp("critic") / "critic_v0", seed=0)


def _rows(n: int = 8) -> dict:
    df = make_rows(n)
    return {"prompt_token_ids": list(df["prompt_token_ids"]), "response_token_ids": list(df["response_token_ids"])}


def test_init_copies_the_policy_backbone_and_round_trips(tiny_checkpoint, critic_v0) -> None:
    policy, _ = load_policy(tiny_checkpoint)
    critic, tok = load_critic(critic_v0)
    assert type(critic).__name__ == "Qwen2ForTokenClassification" and critic.config.num_labels == 1
    backbone = critic.model.state_dict()
    for k, v in policy.model.state_dict().items():
        assert torch.equal(backbone[k], v), k
    assert critic.score.weight.shape == (1, policy.config.hidden_size)
    rows = _rows()
    first = compute_values(critic, rows["prompt_token_ids"], rows["response_token_ids"], tok.pad_token_id, 4)
    reloaded, _ = load_critic(critic_v0)  # a second load of the saved directory gives the same numbers
    again = compute_values(reloaded, rows["prompt_token_ids"], rows["response_token_ids"], tok.pad_token_id, 8)
    assert first == again


def test_values_one_per_response_token_and_independent_of_padding(critic_v0) -> None:
    critic, tok = load_critic(critic_v0)
    rows = _rows()
    vals = compute_values(critic, rows["prompt_token_ids"], rows["response_token_ids"], tok.pad_token_id, 8)
    assert [len(v) for v in vals] == [len(r) for r in rows["response_token_ids"]]
    for i in (0, 3):  # a rollout alone (no padding) gets the values it got inside the padded batch
        alone = compute_values(
            critic, [rows["prompt_token_ids"][i]], [rows["response_token_ids"][i]], tok.pad_token_id, 1
        )
        assert alone[0] == pytest.approx(vals[i], abs=1e-5)
    batch = pad_rollouts(rows["prompt_token_ids"], rows["response_token_ids"], tok.pad_token_id)
    assert response_values(critic, batch).shape == batch["response_mask"].shape  # (N, L)


def _loss(critic, rows: dict, old_values: list, pad_id: int) -> float:
    batch = pad_rollouts(rows["prompt_token_ids"], rows["response_token_ids"], pad_id)
    width = batch["responses"].shape[1]
    with torch.no_grad():
        loss, _ = compute_value_loss(
            response_values(critic, batch),
            ragged_to_padded(rows["returns"], width),
            ragged_to_padded(old_values, width),
            batch["response_mask"],
            cliprange_value=10.0,
        )
    return float(loss)


def test_one_critic_update_reduces_the_value_loss(critic_v0) -> None:
    critic, tok = load_critic(critic_v0)
    rows = _rows()
    rows["values"] = compute_values(critic, rows["prompt_token_ids"], rows["response_token_ids"], tok.pad_token_id, 8)
    rows["returns"] = [[1.0 if i % 2 else -1.0] * len(r) for i, r in enumerate(rows["response_token_ids"])]
    before = _loss(critic, rows, rows["values"], tok.pad_token_id)
    cfg = CriticConfig(optim=OptimConfig(lr=1e-3), ppo_mini_batch_size=2, ppo_micro_batch_size=4, cliprange_value=10.0)
    opt, sched = make_optimizer(critic, cfg.optim)
    m = critic_update(critic, opt, sched, rows, cfg, n_per_prompt=4, pad_id=tok.pad_token_id)
    after = _loss(critic, rows, rows["values"], tok.pad_token_id)
    # the first micro-batch predicts exactly the rollout-time values: the loss reported there is `before`'s scale
    assert after < before * 0.9, (before, after)
    assert m["critic/vf_loss"] > 0 and m["critic/grad_norm"] > 0 and m["critic/lr"] == pytest.approx(1e-3)


def test_vf_clipfrac_is_a_fraction_and_grows_with_a_tight_clip(critic_v0) -> None:
    rows = _rows()
    clipfracs = {}
    for clip in (1e-4, 100.0):
        critic, tok = load_critic(critic_v0)
        rows["values"] = compute_values(
            critic, rows["prompt_token_ids"], rows["response_token_ids"], tok.pad_token_id, 8
        )
        rows["returns"] = [[2.0] * len(r) for r in rows["response_token_ids"]]
        cfg = CriticConfig(
            optim=OptimConfig(lr=1e-3),
            ppo_mini_batch_size=1,
            ppo_micro_batch_size=4,
            ppo_epochs=3,
            cliprange_value=clip,
        )
        opt, sched = make_optimizer(critic, cfg.optim)
        clipfracs[clip] = critic_update(critic, opt, sched, rows, cfg, n_per_prompt=4, pad_id=tok.pad_token_id)[
            "critic/vf_clipfrac"
        ]
    assert 0.0 < clipfracs[1e-4] <= 1.0  # predictions moved > 1e-4 after the first step: clipped
    assert clipfracs[100.0] == 0.0  # nothing moves 100 away


def test_run_critic_update_writes_a_new_version_with_optimizer_state(critic_v0, tmp_path) -> None:
    critic, tok = load_critic(critic_v0)
    rows = _rows()
    rows["values"] = compute_values(critic, rows["prompt_token_ids"], rows["response_token_ids"], tok.pad_token_id, 8)
    rows["returns"] = [[0.5] * len(r) for r in rows["response_token_ids"]]
    cfg = CriticConfig(optim=OptimConfig(lr=1e-3), ppo_mini_batch_size=2, ppo_micro_batch_size=8)
    m = run_critic_update(critic_v0, tmp_path / "critic_v1", rows, cfg, n_per_prompt=4, seed=0)
    assert (tmp_path / "critic_v1" / OPTIMIZER_FILE).is_file() and not (tmp_path / "critic_v1.tmp").exists()
    v1, _ = load_critic(tmp_path / "critic_v1")
    assert not torch.equal(v1.score.weight, critic.score.weight)
    assert m["timing_s/critic_update"] > 0
    m2 = run_critic_update(tmp_path / "critic_v1", tmp_path / "critic_v2", rows, cfg, n_per_prompt=4, seed=1)
    state = torch.load(tmp_path / "critic_v2" / OPTIMIZER_FILE, weights_only=False)
    # 8 rollouts = one mini-batch of 2 prompts x 4 per update: v2's Adam state counts 2 steps, resumed from v1's
    assert state["scheduler"]["last_epoch"] == 2 and float(state["optimizer"]["state"][0]["step"]) == 2
    assert m2["critic/vf_loss"] < m["critic/vf_loss"]


def test_require_critic_creates_v0_lazily_and_names_missing_versions(tiny_checkpoint, tmp_path) -> None:
    import shutil

    store = ModelStore(tmp_path, "run")
    shutil.copytree(tiny_checkpoint, store.policy_dir(0))
    path = require_critic(store, 0, seed=0, needed_by="values of iteration 0")
    assert path == store.critic_dir(0) and (path / "config.json").is_file()
    with pytest.raises(FileNotFoundError, match=r"critic version 2 .* \(have \[0\]\).*iteration 1's critic_checkpoint"):
        require_critic(store, 2, seed=0, needed_by="values of iteration 2")


def _scored(n: int = 8) -> pd.DataFrame:
    df = make_rows(n)
    return df.assign(response_length=df["response_token_ids"].map(len), reward=[float(i % 3 == 0) for i in range(n)])


def test_gae_advantage_table_matches_the_algorithm(critic_v0) -> None:
    scored = _scored()
    vals = values_frame(scored, critic_v0, critic_version=0, micro_batch_size=8)
    out = compute_advantage_table(
        scored, AlgorithmConfig(adv_estimator="gae", gamma=1.0, lam=0.95), values=vals.iloc[::-1]
    )  # joined by rollout_id, not by row order
    lengths = torch.tensor(scored["response_length"].to_numpy())
    width = int(lengths.max())
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    token_rewards = torch.zeros(len(scored), width)
    token_rewards[torch.arange(len(scored)), lengths - 1] = torch.tensor(
        scored["reward"].to_numpy(), dtype=torch.float32
    )
    adv, ret = compute_gae_advantages(token_rewards, ragged_to_padded(vals["values"], width), mask, 1.0, 0.95)
    for i, n in enumerate(lengths.tolist()):
        assert out["token_advantages"].iloc[i] == pytest.approx(adv[i, :n].tolist(), abs=1e-5)
        assert out["returns"].iloc[i] == pytest.approx(ret[i, :n].tolist(), abs=1e-5)
    flat = torch.cat([torch.tensor(list(t)) for t in out["token_advantages"]])
    assert abs(float(flat.mean())) < 1e-5 and float(flat.std()) == pytest.approx(1.0, abs=1e-3)  # whitened


def test_gae_without_values_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="needs the iteration's critic values"):
        compute_advantage_table(_scored(), AlgorithmConfig(adv_estimator="gae"))
    vals = pd.DataFrame({"rollout_id": [0, 1], "values": [[0.0] * 9, [0.0]]})
    with pytest.raises(ValueError, match=r"rollouts \[2, 3"):
        compute_advantage_table(_scored(), AlgorithmConfig(adv_estimator="gae"), values=vals)


def test_update_rows_join_and_data_metrics() -> None:
    scored = _scored(4)
    vals = pd.DataFrame({"rollout_id": scored["rollout_id"], "values": [[0.25] * n for n in scored["response_length"]]})
    adv = compute_advantage_table(scored, AlgorithmConfig(adv_estimator="gae"), values=vals)
    rows = update_rows(adv, vals)
    assert [len(v) for v in rows["values"]] == [len(r) for r in rows["returns"]] == scored["response_length"].tolist()
    m = critic_data_metrics(adv, vals)
    assert m["critic/values/mean"] == pytest.approx(0.25)
    # constant values: returns - values has the variance of returns, so none of it is explained
    assert m["critic/vf_explained_var"] == pytest.approx(0.0, abs=1e-3)
    assert abs(m["critic/advantages/mean"]) < 1e-5
    with pytest.raises(ValueError, match="no row in the values table"):
        update_rows(adv, vals.iloc[:2])


def test_gae_config_rules_are_explained() -> None:
    with pytest.raises(ValidationError, match=r"critic.ppo_mini_batch_size \(5\) must divide data.train_batch_size"):
        load_config(None, ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=5"])
    with pytest.raises(ValidationError, match=r"critic.ppo_micro_batch_size \(7\) must divide the 256 rollouts"):
        load_config(None, ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size=7"])
    with pytest.raises(ValidationError, match=r"algorithm.lam \(1.5\) must lie in \[0, 1\]"):
        load_config(None, ["algorithm.adv_estimator=gae", "algorithm.lam=1.5"])
    assert load_config(None, ["critic.ppo_mini_batch_size=5"]).critic.ppo_mini_batch_size == 5  # ignored unless gae
