"""Lost workers (issue #37 item 1): which errors mean "a node or worker is gone, re-run on rebuilt workers"
(stages.workers.faults.is_worker_loss, what `rlake train` retries an iteration on), and a placement group that
cannot be placed failing within ray.placement_timeout_s instead of waiting silently. The cluster test
(tests/cluster/test_cluster_train.py) kills real nodes."""

from __future__ import annotations

import time

import dagster as dg
import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, OwnerDiedError, RayTaskError

from stages.workers.faults import is_worker_loss
from stages.workers.placement import PlacementTimeoutError, role_placement_group


def _through_dagster(err: BaseException) -> BaseException:
    """The error a real in-process Dagster run raises when its step raises `err` (what the runner catches)."""

    @dg.op
    def step():
        raise err

    @dg.job
    def job():
        step()

    with pytest.raises(Exception) as info:
        job.execute_in_process(instance=dg.DagsterInstance.ephemeral())
    return info.value


def _chained(outer: BaseException, cause: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as inner:
            raise outer from inner
    except BaseException as exc:
        return exc


def test_lost_actors_nodes_and_objects_count_as_worker_loss_through_every_wrapper() -> None:
    died = ActorDiedError()
    task = RayTaskError("RolloutWorker.generate", "traceback", OwnerDiedError("ab" * 14, "", ""))  # weights' owner gone
    assert is_worker_loss(died) and is_worker_loss(ActorUnavailableError("unreachable", None))
    assert is_worker_loss(task) and is_worker_loss(task.as_instanceof_cause())
    assert is_worker_loss(_chained(RuntimeError("stage failed"), died))
    assert is_worker_loss(PlacementTimeoutError("not placed"))
    assert is_worker_loss(_through_dagster(ActorDiedError()))


def test_errors_in_the_work_itself_are_not_worker_loss() -> None:
    """Re-running a bad config or a failing reward function on new workers would fail the same way."""
    assert not is_worker_loss(ValueError("bad input"))
    assert not is_worker_loss(RayTaskError("ActorWorker.update", "traceback", ZeroDivisionError("x")))
    assert not is_worker_loss(_through_dagster(KeyError("rollout_id")))
    # an error handled earlier (its __context__) does not make a later, unrelated error a worker loss
    try:
        try:
            raise ActorDiedError()
        except ActorDiedError:
            raise ValueError("unrelated") from None
    except ValueError as exc:
        assert not is_worker_loss(exc)


def test_a_placement_group_without_capacity_fails_within_the_timeout(ray_session) -> None:
    """No node has the resource (as after losing the only node that had it): a clear error after timeout_s, and
    the group is removed, so a retry starts clean; never the silent wait issue #37 saw (~2.7 minutes)."""
    name = "rlake:test-worker-loss:actor"
    t0 = time.perf_counter()
    with pytest.raises(PlacementTimeoutError) as info:
        role_placement_group(name, [{"CPU": 1.0, "trainer_node": 1.0}], timeout_s=2.0)
    waited = time.perf_counter() - t0
    assert 2.0 <= waited < 20.0, waited
    message = str(info.value)
    assert name in message and "within 2 s (ray.placement_timeout_s)" in message, message
    assert "trainer.max_iteration_retries" in message and "Add nodes with those resources" in message, message
    live = [g for g in ray_session.util.placement_group_table().values() if g.get("name") == name]
    assert all(g["state"] == "REMOVED" for g in live), live


def _all_reduce_with_a_dying_peer(rank: int, store: str, out) -> None:
    """Rank 1 exits mid-run (a crashed process); rank 0's next all-reduce reports it, put on `out`."""
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    dist.all_reduce(torch.ones(4))
    if rank == 1:
        os._exit(1)
    time.sleep(0.5)
    try:
        dist.all_reduce(torch.ones(4))
        out.put(None)
    except RuntimeError as exc:
        out.put(str(exc))


def test_a_gloo_rank_whose_peer_died_counts_as_worker_loss(tmp_path, monkeypatch) -> None:
    """A real 2-rank gloo group (spawned processes): the survivor's RuntimeError, inside the RayTaskError a worker
    group raises, is a lost worker, not an error of the work."""
    import multiprocessing as mp

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_all_reduce_with_a_dying_peer, args=(r, str(tmp_path / "store"), out)) for r in (0, 1)]
    for p in procs:
        p.start()
    message = out.get(timeout=120)
    for p in procs:
        p.join(timeout=30)
    assert message is not None and "Connection closed by peer" in message, message
    assert is_worker_loss(RayTaskError("ActorWorker.update", "traceback", RuntimeError(message)))
