"""Assets read upstream tables at the versions Dagster recorded; re-scoring one past iteration writes one
new scored_rollouts version only; the ppo_kl_within_limit check blocks an update that moved too far.

One real 2-iteration ci_tiny run (Dagster in-process, local Ray, Delta, MLflow sqlite), then single-asset
re-materializations of partition 0 with dg.materialize on the same Dagster instance."""

from __future__ import annotations

import hashlib

import dagster as dg
import pandas as pd
import pytest

from configs.schema import load_config
from stages.io import store
from stages.io.sql import query
from tests.shared_run import CONFIG, RUN

pytestmark = [pytest.mark.slow, pytest.mark.ray]


@pytest.fixture(scope="module")
def run(ci_tiny_run):
    """This module's copy of the shared ci_tiny run (tests/shared_run.py)."""
    out, _ = ci_tiny_run
    return out, dg.DagsterInstance.get()


def _materialize(
    out, instance, asset: str | list[str], overrides: list[str], *, run_id: str = RUN, raise_on_error: bool = True
):
    from pipelines.definitions import ASSETS
    from pipelines.resources import build_resources

    cfg = load_config(CONFIG, [f"trainer.output_dir={out}", f"trainer.run_id={run_id}", *overrides])
    resources = build_resources(cfg)
    instance.add_dynamic_partitions("run", [run_id])
    instance.add_dynamic_partitions("iteration", ["0"])
    return dg.materialize(
        ASSETS,
        selection=[asset] if isinstance(asset, str) else asset,
        partition_key=str(dg.MultiPartitionKey({"run": run_id, "iteration": "0"})),
        instance=instance,
        resources=resources,
        raise_on_error=raise_on_error,
    )


def _uri(out, table: str) -> str:
    return str(out / "tables" / table)


def test_rescore_reads_recorded_rollouts_version_and_writes_one_partition(run) -> None:
    out, instance = run
    (scored_commit,) = store.commit_lineage(_uri(out, "scored_rollouts"), run_id=RUN, iteration=0)
    recorded = scored_commit["upstream"]["rollouts"]
    assert scored_commit["upstream_version_source"] == '{"rollouts": "dagster"}'
    old0 = store.read_partition(_uri(out, "scored_rollouts"), RUN, 0).sort_values("rollout_id").reset_index(drop=True)
    old1 = store.read_partition(_uri(out, "scored_rollouts"), RUN, 1).sort_values("rollout_id").reset_index(drop=True)
    # a newer rollouts version written outside Dagster: the re-score must not read it
    rollouts = store.read_partition(_uri(out, "rollouts"), RUN, 0)
    newer = store.write_partition(
        _uri(out, "rollouts"),
        "rollouts",
        rollouts.assign(response_text="garbage"),
        run_id=RUN,
        iteration=0,
        lineage={"stage": "outside"},
    )
    assert newer > recorded
    before = store.table_version(_uri(out, "scored_rollouts"))

    _materialize(out, instance, "scored_rollouts", ["reward.score=2.0", "reward.format_score=0.5"])

    assert store.table_version(_uri(out, "rollouts")) == newer  # re-scoring wrote no rollouts
    assert store.table_version(_uri(out, "scored_rollouts")) == before + 1
    new_commit = store.commit_lineage(_uri(out, "scored_rollouts"), run_id=RUN, iteration=0)[0]
    assert new_commit["version"] == before + 1 and new_commit["upstream"] == {"rollouts": recorded}
    new0 = store.read_partition(_uri(out, "scored_rollouts"), RUN, 0).sort_values("rollout_id").reset_index(drop=True)
    assert (new0["response_text"] == old0["response_text"]).all()  # the recorded rollouts, not "garbage"
    # reward 1 -> 2 for correct answers; 0 -> 0.5 for well-formed wrong ones (the old run had format_score 0)
    old_cfg = load_config(CONFIG).reward  # correct: score -> 2.0; well-formed but wrong: format_score -> 0.5
    mapping = {old_cfg.score: 2.0, old_cfg.format_score: 0.5, 0.0: 0.0}
    assert set(old0["reward"]) <= set(mapping) and (old0["reward"] == old_cfg.score).any()
    pd.testing.assert_series_equal(new0["reward"], old0["reward"].map(mapping), check_names=False)
    # iteration 1 untouched: same rows, same commits
    now1 = store.read_partition(_uri(out, "scored_rollouts"), RUN, 1).sort_values("rollout_id").reset_index(drop=True)
    pd.testing.assert_frame_equal(now1, old1)
    assert len(store.commit_lineage(_uri(out, "scored_rollouts"), run_id=RUN, iteration=1)) == 1
    # time travel still sees the old scores at the old version
    at_old = store.read_partition(_uri(out, "scored_rollouts"), RUN, 0, version=scored_commit["version"])
    assert sorted(at_old["reward"]) == sorted(old0["reward"])
    changed = query(
        out / "tables",
        "SELECT s.rollout_id, b.reward AS before, s.reward AS after FROM scored_rollouts s "
        "JOIN old b USING (run_id, iteration, rollout_id) WHERE s.reward <> b.reward "
        "ORDER BY s.rollout_id",
        {"old:scored_rollouts": scored_commit["version"]},
    )
    assert changed["rollout_id"].tolist() == old0.loc[old0["reward"] != 0.0, "rollout_id"].tolist()

    # recompute advantages downstream: it reads the re-scored version the re-materialization recorded
    _materialize(out, instance, "advantages", ["reward.score=2.0", "reward.format_score=0.5"])
    adv_commit = store.commit_lineage(_uri(out, "advantages"), run_id=RUN, iteration=0)[0]
    old_logprobs_version = store.commit_lineage(_uri(out, "old_logprobs"), run_id=RUN, iteration=0)[0]["version"]
    assert adv_commit["upstream"] == {
        "scored_rollouts": before + 1,
        "rollouts": recorded,  # the token columns (stages/scored_tokens.py), not the newer version
        "old_logprobs": old_logprobs_version,
    }
    adv = store.read_partition(_uri(out, "advantages"), RUN, 0)
    assert set(adv["reward"]) <= {0.0, 0.5, 2.0}


def test_table_written_outside_dagster_is_read_at_newest_and_says_so(run) -> None:
    out, instance = run
    rows = store.read_partition(_uri(out, "rollouts"), RUN, 1)
    newest = store.write_partition(
        _uri(out, "rollouts"), "rollouts", rows, run_id="outside", iteration=0, lineage={"stage": "outside"}
    )
    # Dagster has materializations of rollouts partition 0, but none of them wrote run "outside"
    _materialize(out, instance, "scored_rollouts", [], run_id="outside")
    (commit,) = store.commit_lineage(_uri(out, "scored_rollouts"), run_id="outside", iteration=0)
    assert commit["upstream"] == {"rollouts": newest}
    assert commit["upstream_version_source"] == '{"rollouts": "newest"}'


def test_ppo_kl_above_limit_blocks_the_iteration(run) -> None:
    out, instance = run
    metrics_before = store.table_version(_uri(out, "iteration_metrics"))
    result = _materialize(
        out, instance, ["policy_checkpoint", "iteration_metrics"], ["trainer.max_ppo_kl=1e-12"], raise_on_error=False
    )
    assert not result.success  # the blocking check failed: iteration_metrics (and so the next iteration) never ran
    assert store.table_version(_uri(out, "iteration_metrics")) == metrics_before
    (check,) = [
        e.asset_check_evaluation_data for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"
    ]
    assert check.check_name == "ppo_kl_within_limit" and not check.passed
    message = check.metadata["message"].value
    assert "trainer.max_ppo_kl = 1e-12" in message and "lower actor.optim.lr" in message
    assert abs(check.metadata["ppo_kl"].value) > 1e-12
    # the training run itself (no limit) passed the check
    key = dg.AssetCheckKey(dg.AssetKey("policy_checkpoint"), "ppo_kl_within_limit")
    statuses = [r.status.value for r in instance.event_log_storage.get_asset_check_execution_history(key, limit=10)]
    assert statuses == ["FAILED", "SUCCEEDED", "SUCCEEDED"]  # newest first: this test, iterations 1 and 0


LENGTH_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(len(solution_str)), "chars": len(solution_str)}
"""


def test_rescore_under_a_custom_reward_shows_which_rows_changed_under_which_version(run, tmp_path) -> None:
    out, instance = run
    uri = _uri(out, "scored_rollouts")
    before = store.commit_lineage(uri, run_id=RUN, iteration=0)[0]
    (builtin,) = before["reward_versions"]
    assert builtin.startswith("stages.data.rewards:score_gsm8k@")  # ci_tiny's rlake/arith rows
    fn = tmp_path / "length_reward.py"
    fn.write_text(LENGTH_REWARD)

    _materialize(out, instance, "scored_rollouts", [f"reward.custom_reward_function.path={fn}"])

    custom = f"length_reward.py:compute_score@{hashlib.sha256(LENGTH_REWARD.encode()).hexdigest()[:12]}"
    after = store.commit_lineage(uri, run_id=RUN, iteration=0)[0]
    assert after["version"] > before["version"] and after["reward_versions"] == [custom]
    # which rows changed after re-scoring, and under which reward version: one query
    changed = query(
        out / "tables",
        "SELECT s.rollout_id, b.reward_version AS version_before, s.reward_version AS version_after, "
        "b.reward AS reward_before, s.reward AS reward_after, s.chars FROM scored_rollouts s "
        "JOIN old b USING (run_id, iteration, rollout_id) "
        f"WHERE s.run_id = '{RUN}' AND s.iteration = 0 AND s.reward IS DISTINCT FROM b.reward ORDER BY s.rollout_id",
        {"old:scored_rollouts": before["version"]},
    )
    old = store.read_partition(uri, RUN, 0, version=before["version"]).sort_values("rollout_id")
    lengths = old["response_text"].str.len()
    assert changed["rollout_id"].tolist() == old.loc[old["reward"] != lengths, "rollout_id"].tolist()
    assert set(changed["version_before"]) == {builtin} and set(changed["version_after"]) == {custom}
    assert (changed["reward_after"] == changed["chars"]).all()
