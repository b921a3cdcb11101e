"""Each per-algorithm YAML of configs/ runs end to end through the real pipeline (Dagster in-process,
local Ray, Delta, MLflow sqlite, the gloo worker group), shrunk to CI size, and the algorithm visibly
took effect: KL loss with a reference table (grpo), unscaled advantages (dr_grpo), leave-one-out (rloo),
KL in the reward with the adaptive controller (reinforce_pp), dynamic sampling + overlong shaping (dapo),
greedy baselines stored beside the samples and subtracted from their returns (remax)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from stages.io import store
from stages.io.advantage_rows import advantage_frame

pytestmark = [pytest.mark.slow, pytest.mark.ray]

CI_SIZE = [
    "data.synthetic.num_train=200",
    "data.synthetic.num_val=16",
    "data.synthetic.max_operand=19",
    "data.train_batch_size=8",
    "data.val_batch_size=16",
    "model.tiny.hidden_size=64",
    "model.tiny.intermediate_size=128",
    "model.tiny.warmstart_steps=150",
    "model.tiny.warmstart_batch_size=32",
    "model.tiny.warmstart_target_loss=null",
    'model.tiny.warmstart_answer_formats=["#### {answer}"]',
    "rollout.name=hf",
    "rollout.n=4",
    "rollout.micro_batch_size=64",
    "actor.ppo_mini_batch_size=4",
    "actor.ppo_micro_batch_size=8",
    "actor.ppo_epochs=1",
    "actor.optim.lr=0.001",
    "reward.format_score=0.1",
    "trainer.test_freq=0",
    "ray.num_cpus=2",
]
"""configs/ci_tiny.yaml's sizes, applied to each algorithm YAML (which is based on tiny_cpu.yaml)."""


class Run:
    def __init__(self, out, run_id: str):
        self.out, self.run_id = out, run_id

    def table(self, name: str, it: int):
        uri = str(self.out / "tables" / name)
        if name == "advantages":  # its rows with the columns joined from rollouts and the log-prob tables
            return advantage_frame(uri, self.run_id, it)
        return store.read_partition(uri, self.run_id, it)

    def metrics(self, key: str) -> list[float]:
        client = MlflowClient(tracking_uri=f"sqlite:///{self.out / 'mlflow.db'}")
        exp = client.get_experiment_by_name("rlake")
        (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`rlake.run_id` = '{self.run_id}'")
        return [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]


@pytest.fixture(scope="module")
def run_algorithm(tmp_path_factory, ray_session):
    from pipelines.runner import run_training

    done: dict[str, Run] = {}

    def run(name: str, steps: int, extra: tuple[str, ...] = ()) -> Run:
        if name not in done:
            out = tmp_path_factory.mktemp(name)
            os.environ["DAGSTER_HOME"] = str(out / "dagster_home")
            try:
                run_training(
                    f"configs/{name}.yaml",
                    [*CI_SIZE, f"trainer.total_training_steps={steps}", f"trainer.output_dir={out}", *extra],
                    run_id=f"e2e-{name}",
                    log=lambda s: None,
                )
            finally:
                os.environ.pop("DAGSTER_HOME", None)
            done[name] = Run(out, f"e2e-{name}")
        return done[name]

    return run


def test_grpo_kl_loss_uses_the_reference_table(run_algorithm) -> None:
    r = run_algorithm("grpo", 1)
    rollouts, ref, adv = r.table("rollouts", 0), r.table("ref_logprobs", 0), r.table("advantages", 0)
    assert ref["rollout_id"].tolist() == sorted(rollouts["rollout_id"]) and set(ref["ref_policy_version"]) == {0}
    assert (
        ref["ref_logprobs"].map(len).to_numpy() == rollouts.sort_values("rollout_id")["response_length"].to_numpy()
    ).all()
    # iteration 0 samples from the reference policy itself: its log-probs are the engine's, up to the HF
    # engine's pad suppression (it renormalizes without the pad token, so its log-probs are >= the model's)
    diff = np.concatenate(
        [
            np.asarray(a) - np.asarray(b)
            for a, b in zip(rollouts.sort_values("rollout_id")["rollout_logprobs"], ref["ref_logprobs"])
        ]
    )
    assert diff.min() > -1e-4 and np.abs(diff).mean() < 1e-3 and np.abs(diff).max() < 2e-2, (diff.min(), diff.max())
    assert all(len(a) == n for a, n in zip(adv["ref_logprobs"], adv["response_token_ids"].map(len)))
    (commit,) = store.commit_lineage(str(r.out / "tables" / "advantages"), run_id=r.run_id, iteration=0)
    assert set(commit["upstream"]) == {"scored_rollouts", "rollouts", "ref_logprobs", "old_logprobs"}
    (kl_loss,) = r.metrics("actor/kl_loss")
    assert np.isfinite(kl_loss) and kl_loss >= 0
    assert r.metrics("actor/pg_loss") and r.metrics("critic/score/mean")


def test_dr_grpo_advantage_is_reward_minus_group_mean(run_algorithm) -> None:
    r = run_algorithm("dr_grpo", 1)
    adv = r.table("advantages", 0)
    centered = adv["reward"] - adv.groupby("group_id")["reward"].transform("mean")
    np.testing.assert_allclose(adv["advantage"], centered, atol=1e-6)  # no division by the group std
    assert not (r.out / "tables" / "ref_logprobs").exists()  # no KL: the reference stage is not in the job
    assert np.isfinite(r.metrics("actor/pg_loss")).all()


def test_rloo_advantage_is_leave_one_out(run_algorithm) -> None:
    r = run_algorithm("rloo", 1)
    adv = r.table("advantages", 0)
    g = adv.groupby("group_id")["reward"]
    loo = adv["reward"] - (g.transform("sum") - adv["reward"]) / (g.transform("count") - 1)
    np.testing.assert_allclose(adv["advantage"], loo, atol=1e-6)
    assert set(adv["adv_estimator"]) == {"rloo"}


def test_reinforce_pp_kl_in_reward_with_adaptive_controller(run_algorithm) -> None:
    r = run_algorithm("reinforce_pp", 2)
    a0, a1 = r.table("advantages", 0), r.table("advantages", 1)
    assert set(a0["kl_coef"]) == {0.01}  # iteration 0: kl_ctrl.kl_coef
    # iteration 1's beta is the controller's update of iteration 0's stored beta by its stored KL
    error = np.clip(a0["reward_kl"].mean() / 0.01 - 1, -0.2, 0.2)
    assert a1["kl_coef"].iloc[0] == pytest.approx(0.01 * (1 + error * len(a0) / 10000), rel=1e-9)
    assert a1["kl_coef"].iloc[0] != 0.01
    penalty, coeff = r.metrics("actor/reward_kl_penalty"), r.metrics("actor/reward_kl_penalty_coeff")
    assert coeff == pytest.approx([0.01, a1["kl_coef"].iloc[0]])
    assert abs(penalty[1]) > 1e-4  # the updated policy differs from the reference: the reward carries a KL term
    assert penalty[1] == pytest.approx(a1["reward_kl"].mean())
    assert set(a1["adv_estimator"]) == {"reinforce_plus_plus"}


def test_dapo_dynamic_sampling_and_overlong_shaping(run_algorithm) -> None:
    # gen_batch_size = train_batch_size: a round of the warm-started policy keeps about 3 in 4 groups (the
    # others are all right or all wrong), so more rounds refill the batch; a 5-token overlong buffer (of 12)
    # reaches ordinary 8-token answers, so the shaping is visible
    r = run_algorithm("dapo", 1, ("data.gen_batch_size=8", "reward.overlong_buffer.len=5"))
    batch, scored, adv = r.table("prompt_batches", 0), r.table("scored_rollouts", 0), r.table("advantages", 0)
    assert (
        sorted(batch["gen_round"].unique()) == [0, 1, 2, 3] and len(batch) == 32
    )  # max_num_gen_batches=4 candidate rounds
    assert adv["group_id"].nunique() == 8 and len(adv) == 32  # the batch was refilled to train_batch_size
    acc = (scored.set_index("rollout_id").loc[adv["rollout_id"], "score"] >= 1.0).astype(float).to_numpy()
    assert (adv.assign(acc=acc).groupby("group_id")["acc"].nunique() == 2).all()  # kept groups have spread
    rounds = sorted(scored["gen_round"].unique())
    assert len(rounds) > 1, "round 0 kept every group: the refill path was not exercised"
    assert rounds == list(range(len(rounds))) and len(scored) == 32 * len(rounds)  # every generated round persisted
    dropped = scored.groupby("group_id")["score"].apply(lambda s: (s >= 1.0).nunique() == 1)
    assert dropped.sum() >= 1 and not set(dropped[dropped].index) & set(adv["group_id"])  # all-equal groups dropped
    want = -np.clip((scored["response_length"].to_numpy() - 7) / 5, 0, 1)  # L_max 12, L_cache 5
    np.testing.assert_allclose(scored["overlong_penalty"], want, atol=1e-9)
    np.testing.assert_allclose(scored["reward"], scored["score"] + scored["overlong_penalty"], atol=1e-9)
    assert (scored.loc[scored["response_length"] >= 12, "overlong_penalty"] == -1.0).all()  # truncated: full penalty
    assert r.metrics("train/num_gen_batches") == [float(len(rounds))]
    assert r.metrics("train/num_groups_kept") == [8.0] and r.metrics("train/num_groups_generated") == [
        8.0 * len(rounds)
    ]
    assert r.metrics("reward/overlong_penalized_frac")[0] > 0


def test_remax_greedy_baselines_stored_and_subtracted(run_algorithm) -> None:
    # 2 iterations: iteration 1 samples from the updated policy, so its KL-in-reward term is not ~0
    r = run_algorithm("remax", 2)
    for it in (0, 1):
        rollouts, scored, adv = r.table("rollouts", it), r.table("scored_rollouts", it), r.table("advantages", it)
        base = rollouts[rollouts["is_baseline"]]
        assert len(base) == 8 and base["group_id"].is_unique and set(base["sample_index"]) == {-1}  # one per prompt
        assert rollouts["rollout_id"].is_unique and len(rollouts) == 8 * (4 + 1)
        assert (rollouts[~rollouts["is_baseline"]].groupby("group_id").size() == 4).all()
        assert not set(adv["rollout_id"]) & set(base["rollout_id"]) and len(adv) == 32  # never trained on
        b = scored[scored["is_baseline"]].set_index("group_id")["reward"]
        kl_sum = adv["kl_coef"] * adv["reward_kl"] * adv["response_token_ids"].map(len)  # beta * sum_t KL_t
        np.testing.assert_allclose(
            adv["advantage"], adv["reward"] - kl_sum - b.loc[adv["group_id"]].to_numpy(), atol=1e-5
        )
        for tokens, returns, g in zip(adv["token_advantages"], adv["returns"], adv["group_id"]):
            np.testing.assert_allclose(np.asarray(tokens), np.asarray(returns) - b[g], atol=1e-6)  # return-to-go - b
        assert set(adv["adv_estimator"]) == {"remax"}
        assert r.metrics("remax/baseline_reward/mean")[it] == pytest.approx(b.mean())
        assert r.metrics("critic/score/mean")[it] == pytest.approx(scored.loc[~scored["is_baseline"], "reward"].mean())
    assert np.abs(r.table("advantages", 1)["reward_kl"]).max() > 1e-4  # the KL term was really in the check
