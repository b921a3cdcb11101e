"""`rlake compare`: two runs logged to a real MLflow sqlite store through the pipeline's TrackerResource."""

from __future__ import annotations

import pytest

from assets.resources import TrackerResource
from configs.schema import load_config
from pipelines.cli import main
from stages.run.compare import best_direction, compare_runs, format_comparison


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("cmp")
    uri = f"sqlite:///{out / 'mlflow.db'}"
    tracker = TrackerResource(tracking_uri=uri, experiment_name="rlake-cmp", artifact_root=(out / "art").as_uri())
    runs = {"lr-high": ["actor.optim.lr=0.001"], "lr-low": ["actor.optim.lr=0.0001", "rollout.n=8"]}
    for k, (name, overrides) in enumerate(runs.items()):
        cfg = load_config("configs/ci_tiny.yaml", [*overrides, f"trainer.run_id={name}"])
        mlflow_id = tracker.run_for(name, cfg)
        assert tracker.run_for(name, cfg) == mlflow_id  # found again by its rlake.run_id tag
        for step, (reward, loss) in enumerate([(0.2, 0.9), (0.5 + 0.1 * k, 0.4), (0.4 + 0.1 * k, 0.6)]):
            tracker.log_metrics(
                mlflow_id,
                {
                    "critic/score/mean": reward,
                    "actor/pg_loss": loss,
                    "val-core/rlake/arith/reward/mean@1": reward,
                    "timing_s/step": 10.0 + step,
                },
                step=step,
            )
    return uri


def test_params_that_differ_and_final_best_metrics(store) -> None:
    c = compare_runs(store, "lr-high", "lr-low")
    assert c.a.experiment == c.b.experiment == "rlake-cmp" and not c.notes
    assert [(k, a, b) for k, a, b in c.param_diffs] == [("actor.optim.lr", "0.001", "0.0001"), ("rollout.n", "4", "8")]
    rows = {r[0]: r[1:] for r in c.metric_rows}
    # history A: reward 0.2, 0.5, 0.4 -> final 0.4, best (max) 0.5; B: 0.2, 0.6, 0.5 -> final 0.5, best 0.6
    fa, fb, ba, bb, sa, sb = rows["val-core/rlake/arith/reward/mean@1"]  # '@' restored from MLflow's '_at_'
    assert (fa, fb, ba, bb, sa, sb) == pytest.approx((0.4, 0.5, 0.5, 0.6, 2, 2))
    # loss 0.9, 0.4, 0.6 in both -> final 0.6, best (min) 0.4; timing has no "best" direction
    assert rows["actor/pg_loss"][:4] == pytest.approx((0.6, 0.6, 0.4, 0.4))
    assert rows["timing_s/step"][2:4] == (None, None)
    text = format_comparison(c)
    assert "actor.optim.lr" in text and "val-core/rlake/arith/reward/mean@1" in text and "trainer.run_id" not in text


def test_cli_prints_the_table_and_filters_metrics(store, capsys) -> None:
    assert main(["compare", "lr-high", "lr-low", "--tracking-uri", store, "--metrics", "val-core,critic"]) == 0
    out = capsys.readouterr().out
    assert "A = lr-high" in out and "B = lr-low" in out and "metrics (2)" in out
    assert "critic/score/mean" in out and "actor/pg_loss" not in out


def test_unknown_run_lists_known_ids(store, capsys) -> None:
    with pytest.raises(ValueError, match=r"no MLflow run tagged rlake.run_id='nope'.*'lr-high', 'lr-low'"):
        compare_runs(store, "lr-high", "nope")
    assert main(["compare", "lr-high", "nope", "--tracking-uri", store]) == 2
    assert "known rlake run ids" in capsys.readouterr().err
    with pytest.raises(ValueError, match="experiment 'other' does not exist"):
        compare_runs(store, "lr-high", "lr-low", experiment="other")


def test_best_direction() -> None:
    assert best_direction("val-aux/gsm8k/reward/mean@4") == "max"
    assert best_direction("actor/pg_loss") == "min"
    assert best_direction("response_length/mean") is None
    assert best_direction("critic/rewards/mean") == "max"
    assert best_direction("timing_s/scored_rollouts") is None  # a timing, though it says "score"
    assert best_direction("critic/score/group_all_equal_frac") is None
