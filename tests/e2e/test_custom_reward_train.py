"""`rlake train` with your own reward function: one ci_tiny iteration through the real CLI entry point
(`pipelines.cli.main`: preflight, Dagster in-process, local Ray, Delta, MLflow sqlite), the function in a
file outside the repository."""

from __future__ import annotations

import hashlib
import json

import pytest

from pipelines.cli import main
from stages.io import store
from stages.io.sql import query

pytestmark = [pytest.mark.slow, pytest.mark.ray]

REWARD = """
import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    found = re.findall(r"#### (-?[0-9]+)", solution_str)
    correct = bool(found) and found[-1] == ground_truth
    return {"score": 1.0 if correct else 0.1 * bool(found), "format_ok": bool(found), "index": extra_info["index"]}
"""


def test_train_scores_with_a_custom_reward_function(tmp_path, ray_session, monkeypatch) -> None:
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "out" / "dagster_home"))  # restored after the test
    fn = tmp_path / "my_rewards" / "format_reward.py"
    fn.parent.mkdir()
    fn.write_text(REWARD)
    out = tmp_path / "out"
    rc = main(
        [
            "train",
            "--config",
            "configs/ci_tiny.yaml",
            "--run-id",
            "custom",
            f"trainer.output_dir={out}",
            "trainer.total_training_steps=1",
            f"reward.custom_reward_function.path={fn}",
        ]
    )
    assert rc == 0
    uri = str(out / "tables" / "scored_rollouts")
    scored = store.read_partition(uri, "custom", 0)
    version = f"format_reward.py:compute_score@{hashlib.sha256(REWARD.encode()).hexdigest()[:12]}"
    assert set(scored["reward_version"]) == {version} and set(scored["reward_fn"]) == {"format_reward.compute_score"}
    assert scored["reward_error"].isna().all() and len(scored) == 8 * 4
    # the extra keys are columns; extra_info travelled prompts -> prompt_batches -> rollouts -> the function
    assert scored["format_ok"].dtype == bool
    assert scored["index"].tolist() == [json.loads(e)["index"] for e in scored["extra_info"]]
    assert (scored["score"] == scored["reward"]).all()
    (commit,) = store.commit_lineage(uri, run_id="custom", iteration=0)
    assert commit["reward_versions"] == [version]
    by_format = query(
        out / "tables",
        "SELECT format_ok, reward_version, count(*) AS n, max(reward) AS best FROM scored_rollouts "
        "WHERE run_id = 'custom' GROUP BY format_ok, reward_version ORDER BY format_ok",
    )
    assert by_format["n"].sum() == 32 and set(by_format["reward_version"]) == {version}
    assert (by_format.loc[~by_format["format_ok"], "best"] == 0.0).all()  # no '#### N': score 0
