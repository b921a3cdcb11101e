"""`rlake train` with your own reward function: one ci_tiny iteration through the real CLI entry point
(`pipelines.cli.main`: preflight, Dagster in-process, local Ray, Delta, MLflow sqlite), the function in a
file outside the repository."""

from __future__ import annotations

import hashlib
import json
import os
import re

import pytest

from pipelines.cli import main
from stages.io import store
from stages.io.sql import query

pytestmark = [pytest.mark.slow, pytest.mark.ray]

REWARD = """
import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    found = re.findall(r"#### (-?[0-9]+)", solution_str)
    if extra_info["index"] % 2 and len(solution_str) % 2 == 0 and solution_str != ground_truth:
        raise ValueError(f"cannot parse {solution_str!r}")  # some rows of some groups
    correct = bool(found) and found[-1] == ground_truth
    return {"score": 1.0 if correct else 0.1 * bool(found), "format_ok": bool(found), "index": extra_info["index"]}
"""


RAISE_LINE = (
    REWARD.splitlines().index('        raise ValueError(f"cannot parse {solution_str!r}")  # some rows of some groups')
    + 1
)


def _raises(row) -> bool:
    """Whether REWARD raises on a scored_rollouts row (never on preflight's probe: the ground truth itself)."""
    index, text = json.loads(row["extra_info"])["index"], row["response_text"]
    return bool(index % 2 and len(text) % 2 == 0 and text != row["ground_truth"])


def _train(out, fn, *overrides: str) -> int:
    return main(
        [
            "train",
            "--config",
            "configs/ci_tiny.yaml",
            "--run-id",
            "custom",
            f"trainer.output_dir={out}",
            f"reward.custom_reward_function.path={fn}",
            *overrides,
        ]
    )


@pytest.fixture(scope="module")
def flagged_run(tmp_path_factory, ray_session):
    """One ci_tiny iteration scored by REWARD under reward.on_error=flag: (output dir, reward file)."""
    tmp = tmp_path_factory.mktemp("custom_reward")
    out = tmp / "out"
    os.environ["DAGSTER_HOME"] = str(out / "dagster_home")
    fn = tmp / "my_rewards" / "format_reward.py"
    fn.parent.mkdir()
    fn.write_text(REWARD)
    rc = _train(out, fn, "trainer.total_training_steps=1", "reward.on_error=flag")
    yield out, fn, rc
    os.environ.pop("DAGSTER_HOME", None)


def test_train_scores_with_a_custom_reward_function_and_trains_without_flagged_rows(flagged_run) -> None:
    out, _, rc = flagged_run
    assert rc == 0
    uri = str(out / "tables" / "scored_rollouts")
    scored = store.read_partition(uri, "custom", 0)
    version = f"format_reward.py:compute_score@{hashlib.sha256(REWARD.encode()).hexdigest()[:12]}"
    assert set(scored["reward_version"]) == {version} and set(scored["reward_fn"]) == {"format_reward.compute_score"}
    assert len(scored) == 8 * 4
    # on_error=flag: the rows the function raised on stay in scored_rollouts, flagged (reward NaN, reward_error)
    flagged = scored["reward_error"].notna()
    assert flagged.tolist() == scored.apply(_raises, axis=1).tolist()
    assert 0 < flagged.sum() < len(scored) and scored.loc[flagged, "reward"].isna().all()
    assert scored.loc[flagged, "reward_error"].str.startswith("ValueError: cannot parse ").all()
    # ... and are left out of the advantages and the update, which trains on the rest
    ok = scored[~flagged]
    adv = store.read_partition(str(out / "tables" / "advantages"), "custom", 0)
    assert sorted(adv["rollout_id"]) == sorted(ok["rollout_id"]) and adv["advantage"].notna().all()
    metrics = store.read_partition(str(out / "tables" / "iteration_metrics"), "custom", 0)
    m = dict(zip(metrics["metric"], metrics["value"], strict=True))
    assert m["actor/num_rollouts"] == len(ok) and m["reward/flagged"] == flagged.sum()
    assert m["critic/score/mean"] == pytest.approx(ok["reward"].mean())  # over the rows trained on
    # the extra keys are columns; extra_info travelled prompts -> prompt_batches -> rollouts -> the function
    assert set(map(type, ok["format_ok"])) == {bool} and scored.loc[flagged, "format_ok"].isna().all()
    assert ok["index"].tolist() == [json.loads(e)["index"] for e in ok["extra_info"]]
    assert (ok["score"] == ok["reward"]).all()
    (commit,) = store.commit_lineage(uri, run_id="custom", iteration=0)
    assert commit["reward_versions"] == [version]
    by_format = query(
        out / "tables",
        "SELECT format_ok, reward_version, count(*) AS n, max(reward) AS best FROM scored_rollouts "
        "WHERE run_id = 'custom' AND reward_error IS NULL GROUP BY format_ok, reward_version ORDER BY format_ok",
    )
    assert by_format["n"].sum() == len(ok) and set(by_format["reward_version"]) == {version}
    assert (by_format.loc[~by_format["format_ok"].astype(bool), "best"] == 0.0).all()  # no '#### N': score 0


def test_a_reward_function_that_raises_stops_train_with_one_line(flagged_run, capfd) -> None:
    """on_error=raise (the run resumed for iteration 1): one error line naming the function, the rollout, the
    function's own file:line and its exception, no Dagster or Ray traceback on the terminal; the full traceback
    in the log file."""
    out, fn, _ = flagged_run
    capfd.readouterr()
    rc = _train(
        out, fn, "trainer.total_training_steps=2", "reward.on_error=raise", "trainer.resume_allow_config_change=true"
    )
    err = capfd.readouterr().err
    assert rc == 2, err
    (line,) = [ln for ln in err.splitlines() if "error" in ln.lower()]
    assert re.fullmatch(
        r"rlake train: error: reward function format_reward\.compute_score failed on rollout \d+ \(prompt_id \d+, "
        rf"data_source 'rlake/arith'\): raised at {re.escape(str(fn))}:{RAISE_LINE}: ValueError: cannot parse .*\. "
        r"Fix the function \(a response it cannot score should score 0\.0\), or set reward\.on_error=flag to "
        r"train on the other rollouts\.",
        line,
    ), err
    assert "\x1b[" not in err and "Traceback" not in err and "Stack Trace" not in err and len(err.splitlines()) <= 4, (
        err
    )
    log = max((out / "logs").glob("train-*.log"), key=lambda p: p.stat().st_mtime).read_text()
    assert "rlake train failed" in log and f'File "{fn}", line {RAISE_LINE}, in compute_score' in log
