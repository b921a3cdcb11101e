"""assets/iteration_metrics.py `materialize` once the metrics are measured: its MLflow calls and `workers` write on
threads of their own (assets.common.Background), joined before it returns, any error raised again. A real MLflow
sqlite store and real Delta tables under tmp_path; the measuring (every stage's partition) and Ray stand in."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

import assets.iteration_metrics as asset
from assets.common import Background
from assets.resources import RolloutStoreResource, TrackerResource
from configs.schema import load_config
from stages.io import store
from stages.io.plots import run_curves_markdown
from stages.io.tracking import VALIDATION_FIGURE

RUN = "im"
METRICS = {"critic/score/mean": 0.5, "actor/pg_loss": -0.1, "timing_s/step": 1.0}
PLACED = [
    {"role": "actor", "rank": 0, "actor_name": f"rlake:{RUN}:actor:b:0", "node_id": "n", "node_ip": "127.0.0.1",
     "pid": 1, "threads": 1, "device": "cpu", "resources": "{}", "placement_group": None, "bundle_index": None}
]  # fmt: skip


class _Ray:
    def ensure(self) -> None:
        pass


def _stage_run(tmp_path, it: int, steps: int = 2) -> SimpleNamespace:
    """What materialize uses of a StageRun: its config, iteration, resources, write and result."""
    rollout_store = RolloutStoreResource(root=str(tmp_path / "tables"))
    tracker = TrackerResource(
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
        experiment_name="rlake-test",
        artifact_root=(tmp_path / "art").as_uri(),
    )
    cfg = load_config("configs/ci_tiny.yaml", [f"trainer.run_id={RUN}", f"trainer.total_training_steps={steps}"])
    writes = []

    def write(rows, *, upstream, policy_version, table="iteration_metrics", **_):
        lineage = {"stage": table, "policy_version": str(policy_version), "upstream": upstream}
        writes.append((table, threading.current_thread().name))
        return store.write_partition(rollout_store.uri(table), table, rows, run_id=RUN, iteration=it, lineage=lineage)

    def result(version, metadata):
        return {"delta_version": version, **metadata}

    return SimpleNamespace(
        cfg=cfg,
        iteration=it,
        tracker=tracker,
        rollout_store=rollout_store,
        ray=_Ray(),
        write=write,
        result=result,
        writes=writes,
    )


@pytest.fixture(autouse=True)
def _measured(monkeypatch) -> None:
    """The iteration's metrics without its stages' partitions (no validation); the run's workers without Ray."""
    monkeypatch.setattr(asset, "measure_iteration", lambda run: (dict(METRICS), None, {"advantages": 3}))
    monkeypatch.setattr(asset, "worker_placements", lambda run_id: PLACED)


@pytest.fixture(params=[True, False], ids=["threads", "inline"])
def remote(request, monkeypatch) -> bool:
    """Whether the step sees a remote MLflow (and so uses threads: Background(threads=True)) or sqlite and local
    files (each call inline, as it always ran)."""
    monkeypatch.setattr(asset, "is_tracking_server", lambda uri: request.param)
    return request.param


def _threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("rlake-")]


def test_the_step_logs_and_writes_what_it_did_inline(tmp_path, remote) -> None:
    """Both iterations' metrics, lineage (the iteration_metrics version written), the `workers` rows and, at the
    last, validation_curve.png and FINISHED; `run_curves` is the figure of the table as written; no thread left."""
    for it in (0, 1):
        run = _stage_run(tmp_path, it)
        out = asset.materialize(run)
        assert out["run_curves"].value == run_curves_markdown(run.rollout_store.location, RUN)
        assert [t for t, _ in run.writes] == ["iteration_metrics", "workers"]
        assert (run.writes[0][1] != run.writes[1][1]) == remote  # the workers write on a thread of its own
        assert _threads() == []
    client = MlflowClient(run.tracker.tracking_uri)
    (mlflow_run,) = client.search_runs(
        [client.get_experiment_by_name("rlake-test").experiment_id], filter_string=f"tags.`rlake.run_id` = '{RUN}'"
    )
    assert mlflow_run.info.status == "FINISHED"
    assert mlflow_run.data.tags["rlake.last_step"] == "2"
    history = client.get_metric_history(mlflow_run.info.run_id, "critic/score/mean")
    assert [(h.step, h.value) for h in history] == [(1, 0.5), (2, 0.5)]
    inputs = {
        (d.dataset.name, t.value)
        for d in mlflow_run.inputs.dataset_inputs
        for t in d.tags
        if t.key == "rlake.delta_version"
    }
    assert inputs == {("iteration_metrics", "0"), ("iteration_metrics", "1")}
    assert VALIDATION_FIGURE in {a.path for a in client.list_artifacts(mlflow_run.info.run_id)}
    workers = store.read_partition(str(tmp_path / "tables" / "workers"), RUN, 1)
    assert workers["actor_name"].tolist() == [PLACED[0]["actor_name"]]


def test_an_mlflow_error_in_the_background_fails_the_step_with_that_error(tmp_path, monkeypatch, remote) -> None:
    """MLflow failing on its thread fails the step with the very exception, once the other calls are done; the calls
    after it on its thread (log_iteration, end_run) fail with it, and the run is not ended. Inline, the step stops
    there, as it always did."""
    down = MlflowException("the tracking server is down")

    def log_metrics(self, mlflow_run_id, metrics, step):
        raise down

    ended = []
    monkeypatch.setattr(TrackerResource, "log_metrics", log_metrics)
    monkeypatch.setattr(TrackerResource, "end_run", lambda self, *a, **kw: ended.append(a))
    run = _stage_run(tmp_path, 1)
    with pytest.raises(MlflowException) as failed:
        asset.materialize(run)
    assert failed.value is down
    written = ["iteration_metrics", "workers"] if remote else []  # joined: the other calls finished
    assert [t for t, _ in run.writes] == written
    assert ended == [] and _threads() == []


def test_background_raises_the_first_error_in_submitted_order_after_joining() -> None:
    order = []

    def fail(msg: str):
        order.append(msg)
        raise RuntimeError(msg)

    with pytest.raises(RuntimeError, match="first") as failed, Background() as bg:
        bg.submit("b", threading.Event().wait, 0.2)
        bg.submit("a", fail, "first")
        bg.submit("b", fail, "second")
        bg.submit("a", order.append, "after first")
        raise ValueError("the block's own")
    assert sorted(order) == ["first", "second"]  # the lanes ran as inline code: "after first" did not
    assert isinstance(failed.value.__context__, ValueError)  # the block's error is kept, not swallowed
    with pytest.raises(KeyError), Background() as bg:  # the background succeeded: the block's error goes on
        bg.submit("a", order.append, "third")
        raise KeyError("block")
    assert order[-1] == "third"


def test_background_calls_get_earlier_results_and_the_callers_pinned_scope() -> None:
    with Background() as bg:
        scope = bg.submit("a", lambda: getattr(store._PINNED, "keys", None))
    assert scope.result() is None  # outside a pinned() scope the thread has none
    with store.pinned(), Background() as bg:
        first = bg.submit("a", lambda: 2)
        doubled = bg.submit("b", lambda x, *, y: x * y, first, y=first)
        scope = bg.submit("b", lambda: store._PINNED.keys)
        mine = store._PINNED.keys
    assert isinstance(first, Future) and doubled.result() == 4
    assert scope.result() is mine  # the same set: a table brought up to date on one thread is on the other
    assert getattr(store._PINNED, "keys", None) is None


def test_background_without_threads_runs_each_call_when_submitted() -> None:
    def boom():
        raise RuntimeError("at once")

    with Background(threads=False) as bg:
        first = bg.submit("a", lambda: threading.current_thread().name)
        assert first.done() and first.result() == threading.current_thread().name
        assert bg.submit("b", lambda x: x + "!", first).result() == first.result() + "!"
        with pytest.raises(RuntimeError, match="at once"):
            bg.submit("a", boom)
