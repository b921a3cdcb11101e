"""Which errors mean a worker or node was lost, so the same work can succeed on rebuilt workers (issue #37).

`rlake train` re-runs an iteration that failed with one of them (pipelines/runner.py, trainer.max_iteration_retries)
and stops at once on any other error: a Python error in a worker's own code, a bad config or a failing reward
function would fail the same way again.
"""

from __future__ import annotations

from ray.exceptions import NodeDiedError, ObjectLostError, RayActorError, WorkerCrashedError

from stages.workers.placement import PlacementTimeoutError

WORKER_LOSS_ERRORS = (RayActorError, NodeDiedError, ObjectLostError, WorkerCrashedError, PlacementTimeoutError)
"""What a lost node or worker process raises: a dead or unreachable actor, a dead node or task worker, an object
whose only copy or owner was there, a placement group that found no capacity in ray.placement_timeout_s.
RayActorError covers ActorDiedError and ActorUnavailableError; ObjectLostError covers OwnerDiedError."""
PEER_LOST = ("Connection closed by peer", "Connection reset by peer")
"""gloo's RuntimeError in a rank whose peer process died mid-collective (`gloo/transport/tcp/pair.cc`): a surviving
rank on another node often reports the loss before Ray's health check marks the lost rank's actor dead."""


def is_worker_loss(exc: BaseException) -> bool:
    """True when `exc`, or an error it wraps (a Ray task's `cause`, a Dagster step's `user_exception`, `__cause__`),
    is in WORKER_LOSS_ERRORS or is gloo's lost-peer error (PEER_LOST): the work can succeed again on rebuilt
    workers. A Python error in a worker's own code is not: re-running it would fail the same way."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        err = todo.pop()
        if id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, WORKER_LOSS_ERRORS):
            return True
        if isinstance(err, RuntimeError) and any(m in str(err) for m in PEER_LOST):
            return True
        for inner in (getattr(err, "cause", None), getattr(err, "user_exception", None)):
            if isinstance(inner, BaseException):
                todo.append(inner)
        if err.__cause__ is not None:
            todo.append(err.__cause__)
    return False
