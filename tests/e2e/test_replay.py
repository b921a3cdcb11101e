"""`rlake replay`: a stored iteration's policy update re-run from its tables reproduces the logged metrics
and the stored next checkpoint (measured: bitwise on CPU), and says so, or why not, otherwise."""

from __future__ import annotations

import json
import shutil

import pytest

from pipelines.cli import main
from stages.io import store
from stages.run.replay import REPLAY_RTOL
from tests.shared_run import CONFIG, RUN

pytestmark = [pytest.mark.slow, pytest.mark.ray]


@pytest.fixture(scope="module")
def trained(ci_tiny_run):
    """This module's copy of the shared ci_tiny run (tests/shared_run.py)."""
    out, _ = ci_tiny_run
    return out


def _replay(out, *extra: str) -> list[str]:
    return [
        "replay",
        "--config",
        CONFIG,
        "--run-id",
        RUN,
        "--iteration",
        "1",
        "--scratch",
        str(out / "scratch"),
        f"trainer.output_dir={out}",
        "trainer.save_freq=1",
        *extra,
    ]


def test_replay_reproduces_logged_update_metrics_and_weights(trained, capsys) -> None:
    out = trained
    # a newer advantages version written outside the run must not be what the replay reads
    adv = store.read_partition(str(out / "tables" / "advantages"), RUN, 1)
    store.write_partition(
        str(out / "tables" / "advantages"),
        "advantages",
        adv.assign(advantage=adv["advantage"] * -3),
        run_id=RUN,
        iteration=1,
        lineage={"stage": "outside"},
    )
    assert main(_replay(out)) == 0
    table = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in table.splitlines() if line.startswith("actor/")}
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm"):
        assert key in rows and rows[key][-1] == "yes", table
        assert float(rows[key][3]) <= REPLAY_RTOL, table
    logged = store.read_partition(str(out / "tables" / "iteration_metrics"), RUN, 1)
    replayed = json.loads((out / "scratch" / "policy_v2" / "update_metrics.json").read_text())
    pg_loss = float(logged.loc[logged["metric"] == "actor/pg_loss", "value"].iloc[0])
    assert abs(replayed["actor/pg_loss"] - pg_loss) <= REPLAY_RTOL * abs(pg_loss)
    assert "weights vs stored policy_v2: max abs diff" in table and "reproduced" in table.splitlines()[-1]


def test_replay_needs_the_run_config_and_the_kept_checkpoint(trained, capsys) -> None:
    out = trained
    assert main(_replay(out, "actor.optim.lr=0.5")) == 2
    assert f"is not the one run '{RUN}' trained with" in capsys.readouterr().err
    start = out / "checkpoints" / RUN / "policy_v1"
    shutil.move(start, out / "aside")
    try:
        assert main(_replay(out)) == 2
        err = capsys.readouterr().err
        assert "policy_v1" in err and "trainer.save_freq=1" in err
    finally:
        shutil.move(out / "aside", start)


def test_replay_exits_nonzero_when_logged_metrics_differ(trained, capsys) -> None:
    out = trained
    uri = str(out / "tables" / "iteration_metrics")
    commit = store.commit_lineage(uri, run_id=RUN, iteration=1)[0]
    rows = store.read_partition(uri, RUN, 1)
    rows.loc[rows["metric"] == "actor/pg_loss", "value"] += 1.0
    store.write_partition(
        uri,
        "iteration_metrics",
        rows.drop(columns=["run_id", "iteration"]),
        run_id=RUN,
        iteration=1,
        lineage={k: commit[k] for k in ("stage", "policy_version", "config_hash", "upstream")},
    )
    assert main(_replay(out)) == 1
    table = capsys.readouterr().out
    assert "NOT reproduced" in table
    (pg,) = [line for line in table.splitlines() if line.startswith("actor/pg_loss")]
    assert pg.endswith("NO")
