"""`rlake rescore`: one past iteration scored again with another reward gets new scored_rollouts (and
advantages) versions for that partition only, from the rollouts it recorded; the printed SQL lists the
changed rows; a partition that was never scored is a what/why/fix error with exit 2."""

from __future__ import annotations

import re
import shlex

import numpy as np
import pandas as pd
import pytest

from pipelines.cli import main
from stages.io import store
from stages.io.sql import query
from tests.shared_run import CONFIG, RUN

pytestmark = [pytest.mark.slow, pytest.mark.ray]


@pytest.fixture(scope="module")
def trained(ci_tiny_run):
    """This module's copy of the shared ci_tiny run (tests/shared_run.py)."""
    out, _ = ci_tiny_run
    return out


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
    # the printed command runs as pasted, from any directory: it names the run's tables (--tables)
    (command,) = [line.split(": ", 1)[1] for line in printed.splitlines() if line.startswith("the changed rows: ")]
    argv = shlex.split(command)
    assert argv[:3] == ["rlake", "sql", "--tables"] and argv[3] == str(out / "tables")
    assert main(argv[1:]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 1 + changed  # the header and the changed rows
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
    assert f"no scored_rollouts for run '{RUN}' iteration 7" in err
    assert f"runs there: ['{RUN}']" in err and "--iteration" in err


def _judge_overrides(out, regex: str) -> list[str]:
    policies = sorted((out / "checkpoints" / RUN).glob("policy_v*"), key=lambda p: int(p.name[len("policy_v") :]))
    return [
        f"trainer.output_dir={out}",
        "reward.judge.enable=true",
        f"reward.judge.model_path={policies[0]}",  # the run's warm-started policy, as a judge that answers
        "reward.judge.prompt_template='{question} {response}'",  # overrides are YAML: quoted, else {..} is a map
        f"reward.judge.score_regex='{regex}'",
        "reward.judge.max_tokens=12",
    ]


def test_rescore_with_a_judge_stores_verdicts_and_flags_unparsed_ones(trained, capsys) -> None:
    """The tiny judge is the run's warm-started policy v0, prompted '{question} {response}' (e.g.
    '11+17= #### 28'): it continues with digits ('## 26', '1'), so score_regex '(-?\\d+)\\s*$' (a number at
    the end) reads a score from most verdicts; 'Score: (\\d)' reads none: every row flagged (judge_error),
    not a crash, and under combine=replace its reward is 0 (ci_tiny has no overlong shaping)."""
    out = trained
    argv = ["rescore", "--config", CONFIG, "--run-id", RUN, "--iteration", "1"]
    regex = r"(-?\d+)\s*$"
    assert main([*argv, *_judge_overrides(out, regex)]) == 0, capsys.readouterr()
    judged = _partition(out, "judgements", 1)
    scored = _partition(out, "scored_rollouts", 1)
    assert judged["judge_error"].isna().any(), judged[["judge_output", "judge_error"]].head()
    for _, row in judged.iterrows():  # each score is what the regex reads from the stored verdict, or flagged
        match = re.search(regex, row["judge_output"])
        if match is not None:
            assert row["judge_score"] == float(match.group(1)) and row["judge_error"] is None
        else:
            assert np.isnan(row["judge_score"]) and "does not match" in row["judge_error"]
    assert (scored["reward"].to_numpy() == np.nan_to_num(judged["judge_score"].to_numpy())).all()
    prompts = store.read_partition(_uri(out, "prompts"), RUN, -1)
    question = {
        pid: [m["content"] for m in msgs if m["role"] == "user"][-1]
        for pid, msgs in zip(prompts["prompt_id"], prompts["prompt"], strict=True)
    }
    for p, pid, r in zip(judged["judge_prompt"], scored["prompt_id"], scored["response_text"], strict=True):
        assert p == f"{question[pid]} {r}"  # the template filled with the user message and the response
    assert judged["judge_model"].nunique() == 1
    lineage = store.commit_lineage(_uri(out, "scored_rollouts"), run_id=RUN, iteration=1)[0]
    judged_version = store.commit_lineage(_uri(out, "judgements"), run_id=RUN, iteration=1)[0]["version"]
    assert lineage["upstream"]["judgements"] == judged_version

    assert main([*argv, *_judge_overrides(out, r"Score: (\d)")]) == 0, capsys.readouterr()
    judged = _partition(out, "judgements", 1)
    scored = _partition(out, "scored_rollouts", 1)
    assert judged["judge_score"].isna().all()
    assert judged["judge_error"].str.contains("does not match the judge's output").all()
    assert (scored["reward"] == 0.0).all() and scored["judge_error"].notna().all()
