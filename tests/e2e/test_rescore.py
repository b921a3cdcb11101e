"""`rlake rescore`: one past iteration scored again with another reward gets new scored_rollouts (and
advantages) versions for that partition only, from the rollouts it recorded; the printed SQL lists the
changed rows; a partition that was never scored is a what/why/fix error with exit 2."""

from __future__ import annotations

import os

import pandas as pd
import pytest

from pipelines.cli import main
from stages.io import store
from stages.io.sql import query

pytestmark = [pytest.mark.slow, pytest.mark.ray]
RUN = "rescore-run"
CONFIG = "configs/ci_tiny.yaml"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, ray_session):
    from pipelines.runner import run_training

    out = tmp_path_factory.mktemp("rescore")
    os.environ["DAGSTER_HOME"] = str(out / "dagster_home")
    run_training(CONFIG, [f"trainer.output_dir={out}"], run_id=RUN, log=lambda s: None)
    yield out
    os.environ.pop("DAGSTER_HOME", None)


def _uri(out, table: str) -> str:
    return str(out / "tables" / table)


def _partition(out, table: str, iteration: int, version: int | None = None) -> pd.DataFrame:
    df = store.read_partition(_uri(out, table), RUN, iteration, version=version)
    return df.sort_values("rollout_id").reset_index(drop=True)


def test_rescore_writes_one_partition_with_the_new_reward(trained, capsys) -> None:
    out = trained
    before0 = store.commit_lineage(_uri(out, "scored_rollouts"), run_id=RUN, iteration=0)[0]["version"]
    old0, old1 = _partition(out, "scored_rollouts", 0), _partition(out, "scored_rollouts", 1)
    rollouts_version = store.table_version(_uri(out, "rollouts"))
    argv = ["rescore", "--config", CONFIG, "--run-id", RUN, "--iteration", "0", "--advantages"]
    code = main([*argv, f"trainer.output_dir={out}", "reward.score=2.0", "reward.format_score=0.5"])
    printed = capsys.readouterr().out
    assert code == 0, printed

    after = store.commit_lineage(_uri(out, "scored_rollouts"), run_id=RUN, iteration=0)[0]
    assert after["version"] > before0
    assert store.table_version(_uri(out, "rollouts")) == rollouts_version  # nothing generated again
    new0 = _partition(out, "scored_rollouts", 0)
    assert (new0["response_text"] == old0["response_text"]).all()
    # ci_tiny scores 1.0 (right), 0.1 (format only) or 0.0 (no answer); with score 2 and format_score 0.5 every
    # old 1.0 is now 2.0, and nothing else rises above 0.5
    assert (new0.loc[old0["reward"] == 1.0, "reward"] == 2.0).all()
    assert (new0.loc[old0["reward"] != 1.0, "reward"] <= 0.5).all()
    pd.testing.assert_frame_equal(_partition(out, "scored_rollouts", 1), old1)  # the other iteration untouched

    adv = store.commit_lineage(_uri(out, "advantages"), run_id=RUN, iteration=0)[0]
    assert adv["upstream"]["scored_rollouts"] == after["version"]
    assert set(_partition(out, "advantages", 0)["reward"]) <= {0.0, 0.5, 2.0}

    changed = int((new0["reward"] != old0["reward"]).sum())
    assert f"({changed} of {len(new0)} rewards changed)" in printed
    assert f"--version old:scored_rollouts={before0}" in printed
    sql = printed.split("--version old:scored_rollouts=", 1)[1].split(" ", 1)[1].strip().strip('"')
    rows = query(out / "tables", sql, {"old:scored_rollouts": before0})
    assert len(rows) == changed and (rows["reward_after"] != rows["reward_before"]).all()
    # the built-in scorer's version (its source did not change) scored both; the config change is in lineage
    assert set(rows["version_before"]) == set(rows["version_after"]) == set(new0["reward_version"])
    assert (
        after["config_hash"]
        != store.commit_lineage(_uri(out, "scored_rollouts"), run_id=RUN, iteration=1)[0]["config_hash"]
    )


def test_rescore_of_a_partition_never_scored_says_why(trained, capsys) -> None:
    code = main(["rescore", "--config", CONFIG, "--run-id", RUN, "--iteration", "7", f"trainer.output_dir={trained}"])
    err = capsys.readouterr().err
    assert code == 2
    assert "no scored_rollouts for run 'rescore-run' iteration 7" in err
    assert "runs there: ['rescore-run']" in err and "--iteration" in err
