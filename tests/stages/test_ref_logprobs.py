"""Reference log-prob stage: equals the rollout engine's log-probs for the policy that sampled
(iteration 0: reference == policy v0), is batch-composition independent, and runs on the ref workers."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from configs.schema import RolloutConfig
from stages.dag import uses_reference as needs_ref_logprobs
from stages.models.policy import encode_chat, load_policy, save_policy
from stages.models.tiny import build_tiny_model
from stages.ref_logprobs import REF_POLICY_VERSION, compute_ref_logprobs
from stages.rollouts import generate_rollouts
from stages.workers.ref_worker import RefWorker


def _rollouts(model_dir, n_prompts: int = 5, n: int = 3, temperature: float = 1.0) -> pd.DataFrame:
    _, tok = load_policy(model_dir)
    prompts = [encode_chat(tok, [{"role": "user", "content": f"{i * 7}+{i}="}])[0] for i in range(n_prompts)]
    batch = pd.DataFrame(
        {"prompt_id": range(n_prompts), "prompt_token_ids": prompts, "group_id": range(n_prompts), "policy_version": 0}
    )
    cfg = RolloutConfig(name="hf", n=n, temperature=temperature)
    return generate_rollouts(batch, model_dir=str(model_dir), rollout_cfg=cfg, max_tokens=6, seed=0, use_ray=False)


@pytest.fixture(scope="module")
def pad_is_eos_checkpoint(tiny_checkpoint, tmp_path_factory):
    """tiny_checkpoint with pad == eos: the HF engine then samples from the model's plain softmax (with a
    separate pad token it suppresses pad and renormalizes, which the trainer's recomputation does not)."""
    model, tok = load_policy(tiny_checkpoint)
    tok.pad_token = tok.eos_token
    return save_policy(model, tok, tmp_path_factory.mktemp("pad_eos") / "policy_v0")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_ref_logprobs_of_policy_v0_equal_rollout_logprobs(pad_is_eos_checkpoint, temperature) -> None:
    """At the sampling temperature (verl's ref and actor divide logits by rollout.temperature) the
    reference log-probs of policy v0 are the engine's sampling log-probs."""
    out = _rollouts(pad_is_eos_checkpoint, temperature=temperature)
    ref = compute_ref_logprobs(
        out, model_dir=pad_is_eos_checkpoint, micro_batch_size=4, use_ray=False, temperature=temperature
    )
    assert ref["rollout_id"].tolist() == out["rollout_id"].tolist()
    assert (ref["ref_logprobs"].map(len) == out["response_length"]).all()
    assert set(ref["ref_policy_version"]) == {0}
    got = np.concatenate([np.asarray(x) for x in ref["ref_logprobs"]])
    want = np.concatenate([np.asarray(x) for x in out["rollout_logprobs"]])
    assert got.size == want.size > 0 and (got < 0).all()
    np.testing.assert_allclose(got, want, atol=1e-4)
    if temperature != 1.0:  # at temperature 1 the same tokens have other log-probs
        plain = compute_ref_logprobs(out, model_dir=pad_is_eos_checkpoint, micro_batch_size=4, use_ray=False)
        assert np.abs(np.concatenate([np.asarray(x) for x in plain["ref_logprobs"]]) - want).max() > 1e-2


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_ref_logprobs_equal_the_trainers_recomputation(tiny_checkpoint, temperature) -> None:
    from stages.train.actor import compute_logprobs
    from stages.train.batching import pad_rollouts

    out = _rollouts(tiny_checkpoint, n_prompts=3, n=2)
    ref = compute_ref_logprobs(
        out, model_dir=str(tiny_checkpoint), micro_batch_size=2, use_ray=False, temperature=temperature
    )
    model, tok = load_policy(tiny_checkpoint)
    batch = pad_rollouts(
        [list(p) for p in out["prompt_token_ids"]], [list(r) for r in out["response_token_ids"]], tok.pad_token_id
    )
    want = compute_logprobs(model, batch, 64, temperature)  # (N, L)
    for i, r in enumerate(ref["ref_logprobs"]):
        np.testing.assert_allclose(r, want[i, : len(r)].numpy(), atol=1e-5)


def test_ref_logprobs_do_not_depend_on_micro_batching(tiny_checkpoint) -> None:
    out = _rollouts(tiny_checkpoint, n_prompts=3, n=2)

    def ref(micro_batch_size: int) -> pd.DataFrame:
        return RefWorker(
            0,
            1,
            torch.get_num_threads(),
            model_dir=str(tiny_checkpoint),
            ref_policy_version=REF_POLICY_VERSION,
            micro_batch_size=micro_batch_size,
        )

    one = ref(1).compute_ref_log_prob(out)
    all_ = ref(64).compute_ref_log_prob(out)
    for a, b in zip(one["ref_logprobs"], all_["ref_logprobs"]):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_another_reference_gives_other_logprobs(tiny_checkpoint, tmp_path) -> None:
    """A reference that is not the sampling policy yields a nonzero KL (the stage reads the model it is given)."""
    from configs.schema import TinyModelConfig

    _, tok = load_policy(tiny_checkpoint)
    save_policy(
        build_tiny_model(TinyModelConfig(hidden_size=64, intermediate_size=128), len(tok), seed=5),
        tok,
        tmp_path / "other",
    )
    out = _rollouts(tiny_checkpoint, n_prompts=2, n=2)
    ref = compute_ref_logprobs(out, model_dir=str(tmp_path / "other"), use_ray=False)
    diff = [np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in zip(ref["ref_logprobs"], out["rollout_logprobs"])]
    assert max(diff) > 1e-2


def test_needs_ref_logprobs_follows_the_kl_switches() -> None:
    from configs.schema import load_config

    assert not needs_ref_logprobs(load_config(None))
    assert needs_ref_logprobs(load_config(None, ["actor.use_kl_loss=true"]))
    assert needs_ref_logprobs(load_config(None, ["algorithm.use_kl_in_reward=true"]))


@pytest.mark.ray
def test_ref_logprobs_on_ref_workers(ray_session, tiny_checkpoint) -> None:
    out = _rollouts(tiny_checkpoint, n_prompts=4, n=2)
    local = compute_ref_logprobs(out, model_dir=str(tiny_checkpoint), use_ray=False)
    remote = compute_ref_logprobs(out, model_dir=str(tiny_checkpoint), num_workers=2, use_ray=True)
    assert remote["rollout_id"].tolist() == local["rollout_id"].tolist()
    for a, b in zip(remote["ref_logprobs"], local["ref_logprobs"]):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert torch.isfinite(torch.tensor(np.concatenate(list(remote["ref_logprobs"])))).all()


# ---- KL in the reward and the KL controller, in the advantage stage -------------------------------------


def _kl_scored() -> tuple[pd.DataFrame, pd.DataFrame]:
    scored = pd.DataFrame(
        {
            "rollout_id": [0, 1],
            "group_id": [0, 0],
            "policy_version": 0,
            "prompt_token_ids": [[5, 6], [5, 6]],
            "response_token_ids": [[7, 8], [9, 10]],
            "response_length": [2, 2],
            "reward": [1.0, 0.0],
            "rollout_logprobs": [[-1.0, -1.0], [-2.0, -2.0]],
        }
    )
    ref = pd.DataFrame({"rollout_id": [1, 0], "ref_logprobs": [[-2.0, -3.0], [-1.5, -1.0]]})  # any row order
    return scored, ref


def test_kl_in_reward_hand_derived() -> None:
    from configs.schema import AlgorithmConfig, KLControlConfig
    from stages.advantage_table import compute_advantage_table

    scored, ref = _kl_scored()
    cfg = AlgorithmConfig(
        norm_adv_by_std_in_grpo=False, use_kl_in_reward=True, kl_penalty="kl", kl_ctrl=KLControlConfig(kl_coef=0.1)
    )
    out = compute_advantage_table(scored, cfg, ref=ref, kl_coef=0.1)
    # k1 = logprobs - ref: row 0 [0.5, 0], row 1 [0, 1]; beta 0.1
    # token rewards: row 0 [-0.05, 1 - 0] (sum 0.95), row 1 [0, 0 - 0.1] (sum -0.1)
    # Dr.GRPO on the sums: mean 0.425 -> advantages +0.525, -0.525
    assert out["advantage"].tolist() == pytest.approx([0.525, -0.525], abs=1e-6)
    assert out["reward_kl"].tolist() == pytest.approx([0.25, 0.5])  # token-mean KL per rollout
    assert out["kl_coef"].tolist() == [0.1, 0.1]
    assert out["ref_logprobs"].tolist() == [[-1.5, -1.0], [-2.0, -3.0]]  # aligned by rollout_id
    plain = compute_advantage_table(scored, AlgorithmConfig(norm_adv_by_std_in_grpo=False), ref=ref)
    assert plain["advantage"].tolist() == pytest.approx([0.5, -0.5])  # KL loss only: rewards untouched
    assert plain["ref_logprobs"].tolist() == [[-1.5, -1.0], [-2.0, -3.0]] and np.isnan(plain["kl_coef"]).all()


def test_kl_in_reward_without_ref_is_a_clear_error() -> None:
    from configs.schema import AlgorithmConfig
    from stages.advantage_table import compute_advantage_table

    scored, ref = _kl_scored()
    with pytest.raises(ValueError, match="needs the iteration's ref_logprobs table"):
        compute_advantage_table(scored, AlgorithmConfig(use_kl_in_reward=True))
    with pytest.raises(ValueError, match=r"rollouts \[1\] have no reference log-probs"):
        compute_advantage_table(scored, AlgorithmConfig(use_kl_in_reward=True), ref=ref.iloc[1:], kl_coef=0.1)


def test_adaptive_kl_coef_follows_from_the_previous_iterations_stored_kl() -> None:
    from configs.schema import AlgorithmConfig, KLControlConfig
    from stages.advantage_table import kl_coef_for_iteration

    ctrl = KLControlConfig(type="adaptive", kl_coef=0.2, target_kl=0.1, horizon=10)
    cfg = AlgorithmConfig(use_kl_in_reward=True, kl_ctrl=ctrl)
    assert kl_coef_for_iteration(cfg, None) == 0.2  # iteration 0: the initial beta
    prev = pd.DataFrame({"kl_coef": [0.1, 0.1], "reward_kl": [0.25, 0.5]})
    # KL 0.375 / target 0.1 - 1 = 2.75 -> clipped 0.2; beta = 0.1 * (1 + 0.2 * 2 rollouts / 10) = 0.104
    assert kl_coef_for_iteration(cfg, prev) == pytest.approx(0.104)
    low = pd.DataFrame({"kl_coef": [0.1] * 4, "reward_kl": [0.09] * 4})
    # 0.09 / 0.1 - 1 = -0.1; beta = 0.1 * (1 - 0.1 * 4 / 10) = 0.096
    assert kl_coef_for_iteration(cfg, low) == pytest.approx(0.096)
    fixed = AlgorithmConfig(use_kl_in_reward=True, kl_ctrl=KLControlConfig(kl_coef=0.3))
    assert kl_coef_for_iteration(fixed, prev) == 0.3
    with pytest.raises(ValueError, match="no KL-in-reward coefficient"):
        kl_coef_for_iteration(cfg, pd.DataFrame({"kl_coef": [np.nan], "reward_kl": [np.nan]}))


def test_kl_config_errors_say_what_and_how() -> None:
    from pydantic import ValidationError

    from configs.schema import load_config

    with pytest.raises(ValidationError, match="kl_penalty='full' needs the rollout policy's whole"):
        load_config(None, ["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=full"])
    with pytest.raises(ValidationError, match="target_kl > 0 and horizon > 0"):
        load_config(None, ["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=0"])


def test_iteration_job_includes_the_reference_stage_only_with_kl() -> None:
    from configs.schema import load_config
    from pipelines.jobs import iteration_assets

    assert "ref_logprobs" not in iteration_assets(load_config(None))
    for switch in ("actor.use_kl_loss=true", "algorithm.use_kl_in_reward=true"):
        names = iteration_assets(load_config(None, [switch]))
        assert names.index("ref_logprobs") == names.index("rollouts") + 1
