"""The "actor" role's ranks as one Ray Train run (actor.worker_backend='ray_train').

The ranks are the workers of ONE `DataParallelTrainer.fit()` per rlake run, not one per iteration (a fit takes
~10 s to start on the 2-core box), so the policy and the optimizer stay resident across iterations exactly as in a
`WorkerGroup` (stages/workers/group.py). Ray Train owns the ranks' processes, places them (`ScalingConfig`) and
restarts them (`FailureConfig`): when a rank's process or node is lost, Ray Train tears the group down and starts it
again by itself. The new ranks hold nothing; each request names its policy checkpoint, so they load the last
committed one (ActorWorker loads a policy that is not resident).

How requests reach the ranks: the fit runs in a detached, named host actor, `TrainHost`, named as rank 0 of the
role (`rlake:<run>:<role>:<build>:0`), so every later stage and per-iteration process of the run finds it as it
finds a WorkerGroup. Each rank's training function (`serve_rank`) builds the role's worker class (ActorWorker: the
same class and code as with the WorkerGroup) and serves the host's commands: fetch the next command, run that
method, post the result. Commands are numbered; a fetch never consumes one, and a restarted group skips every
number issued before it started (a dead group's pending fetches must not take the new group's commands).
Arguments and results travel through Ray's object store (the host handles references only).

`TrainGroup.call_each` behaves as `WorkerGroup.call_each`: a rank that raises fails the call with its exception
(the group is stopped, as a WorkerGroup is killed); a rank lost while a call is in flight fails it with
`TrainRankLostError`, a RayActorError, so `call_with_retry` retries the call, on the group Ray Train restarted
(it does not kill it: `restarts_itself`). Once Ray Train is out of restarts the host is stopped and the next
`worker_group` call starts a new fit.

Why DataParallelTrainer and not TorchTrainer: TorchTrainer's rendezvous (`env://`) opens a TCPStore that listens
on every interface, which rlake never does. The ranks join their gloo group through rlake's own rendezvous: a
FileStore on the local default, a TCPStore bound to rank 0's node IP on a cluster (stages/workers/rendezvous.py).

Not supported (refused by the config, configs/schema.py): a GPU pool. Colocating the trainer ranks with the
rollout engines on the same GPUs (verl's hybrid engine, rlake's GpuPool) needs the ranks inside the pool's
existing placement-group bundles, and Ray Train's `ScalingConfig` cannot name an existing placement group or
bundle (it always creates its own), so it could only reserve GPUs the pool already holds.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
import traceback
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from stages.workers.group import WorkerGroup, _find, _kill_groups_at_exit, _method_name, _role_prefix

log = logging.getLogger(__name__)

TINY_CPU = 0.001
"""CPUs a rank requests when ray.resources_per_worker names none for its role: Ray Train refuses an empty bundle,
and a WorkerGroup rank reserves nothing on the local default (the stages run one at a time)."""
POLL_S = 1.0
"""How often a waiting command fetch or call re-checks that its group attempt is still the live one."""


class TrainRankLostError(RayActorError):
    """A Ray Train rank was lost while a call was in flight. restarts_itself: Ray Train is restarting the group
    (retry the call on it); False: it is out of restarts (the host stopped; a new group must be built)."""

    def __init__(self, message: str, *, restarts_itself: bool) -> None:
        super().__init__()
        self.message, self.restarts_itself = message, restarts_itself

    def __str__(self) -> str:
        return self.message


class TrainHost:
    """Holds the role's Ray Train fit and hands the driver's commands to its ranks (a detached, threaded actor)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.cv = threading.Condition()
        self.calls = threading.Lock()  # one call at a time, as a Ray actor runs a WorkerGroup rank's calls
        self.seq, self.skip_to, self.attempt = 0, 0, 0
        self.command: tuple[int, str, list] | None = None
        self.results: dict[int, dict[int, tuple[bool, Any]]] = {}
        self.pids: dict[int, int] = {}
        self.placements: dict[int, dict] = {}
        self.handles: dict[int, Any] = {}
        self.joined: set[int] = set()
        self.rendezvous: dict[int, str] = {}
        self.ended: str | None = None
        self.store_dir = tempfile.mkdtemp(prefix="rlake-train-")
        threading.Thread(target=self._fit, daemon=True).start()

    def shape(self) -> str:
        return self.spec["shape"]

    def alive(self) -> bool:
        """False once the fit ended (out of restarts, or stopped): the group must be built again."""
        return self.ended is None

    def pid(self) -> int:
        return os.getpid()

    def state(self) -> dict[str, Any]:
        """The group's attempt (restarts so far), the ranks' pids and the last command's number."""
        with self.cv:
            return {"attempt": self.attempt, "pids": dict(self.pids), "seq": self.seq, "ended": self.ended}

    def placement(self) -> dict:
        """Rank 0's Worker.placement() as it reported it when it joined ({} before it did)."""
        return dict(self.placements.get(0, {}))

    def _fit(self) -> None:
        from ray.train import BackendConfig, FailureConfig, RunConfig, ScalingConfig  # noqa: PLC0415 - the host only
        from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer  # noqa: PLC0415 - the host only

        s = self.spec
        trainer = DataParallelTrainer(
            serve_rank,
            train_loop_config={"host": s["name"], "namespace": ray.get_runtime_context().namespace, "spec": s},
            backend_config=BackendConfig(),
            scaling_config=ScalingConfig(
                num_workers=s["num_workers"], resources_per_worker=s["resources"], placement_strategy="PACK"
            ),
            run_config=RunConfig(
                name=s["name"].replace(":", "-"),
                storage_path=self.store_dir,
                failure_config=FailureConfig(max_failures=s["max_failures"]),
            ),
        )
        try:
            trainer.fit()
            outcome = "the Ray Train run ended"
        except Exception as exc:  # out of restarts, or torn down
            outcome = f"the Ray Train run failed: {' '.join(str(exc).split())[:2000]}"
        with self.cv:
            self.ended = self.ended or outcome
            self.cv.notify_all()

    # ---- the ranks' side ----
    def join(self, rank: int, pid: int, placement: dict, handle: Any) -> dict[str, Any]:
        """A rank's process started serving. A rank seen before in another process means Ray Train restarted the
        group: a new attempt starts, the call in flight (if any) fails, and the ranks rendezvous again. handle:
        the rank's Ray Train worker actor, probed when a call fails (`_rank_lost`)."""
        with self.cv:
            if rank in self.joined and self.pids.get(rank) != pid:
                self.attempt += 1
                self.joined, self.handles, self.skip_to = set(), {}, self.seq
                self.cv.notify_all()
            self.joined.add(rank)
            self.pids[rank], self.placements[rank] = pid, placement
            self.handles[rank] = handle
            return {"attempt": self.attempt, "after": self.skip_to, "store_dir": self.store_dir}

    def set_rendezvous(self, attempt: int, init_method: str) -> None:
        with self.cv:
            self.rendezvous[attempt] = init_method
            self.cv.notify_all()

    def get_rendezvous(self, attempt: int) -> str | None:
        """Rank 0's init_method for group attempt `attempt`; None when a newer attempt started meanwhile."""
        with self.cv:
            self.cv.wait_for(lambda: attempt in self.rendezvous or attempt != self.attempt, timeout=600)
            return self.rendezvous.get(attempt) if attempt == self.attempt else None

    def next(self, attempt: int, after: int) -> tuple[int, str, list] | None:
        """The first command numbered after `after` for a rank of group attempt `attempt` (None: stop serving)."""
        with self.cv:
            while True:
                if attempt != self.attempt or self.ended:
                    return None
                if self.command is not None and self.command[0] > after:
                    return self.command
                self.cv.wait(timeout=POLL_S)

    def done(self, attempt: int, rank: int, seq: int, ok: bool, value: Any) -> None:
        with self.cv:
            if attempt == self.attempt:
                self.results.setdefault(seq, {})[rank] = (ok, value)
                self.cv.notify_all()

    # ---- the driver's side ----
    def call_each(self, name: str, arg_refs: list) -> list:
        """Method `name` on every rank: rank i with the arguments behind arg_refs[i][0] (None: rank i sits the
        call out). One (ok, value) per rank, or [("lost", why, restarts_itself)] when the group was lost."""
        with self.calls:
            with self.cv:
                self.seq += 1
                seq, attempt = self.seq, self.attempt
                self.command = (seq, name, arg_refs)
                self.cv.notify_all()
            while (got := self._outcome(seq, attempt)) is None:
                pass
            if any(r[0] is False for r in got) and self._rank_lost():
                self._condemn(attempt)  # a rank died, and a peer raised because of it (a broken collective)
                return self._outcome(seq, attempt) or []
            return got

    def _outcome(self, seq: int, attempt: int) -> list | None:
        """Waits up to POLL_S for call `seq`: [lost] when its group attempt ended; every rank's (ok, value) when
        all answered, or once one raised (its peers may wait in a collective); else None (still running)."""
        world = self.spec["num_workers"]
        with self.cv:
            self.cv.wait(timeout=POLL_S)
            if attempt != self.attempt or self.ended:
                self.results.pop(seq, None)
                why = self.ended or f"a rank of the {self.spec['role']} Ray Train group was lost"
                return [("lost", why, self.ended is None)]
            got = self.results.get(seq, {})
            if len(got) < world and all(ok for ok, _ in got.values()):
                return None
            self.results.pop(seq, None)
            return [got.get(r, (None, None)) for r in range(world)]

    def _rank_lost(self) -> bool:
        """Whether a rank of the current group attempt is dead (its Ray Train worker actor is gone)."""
        for handle in list(self.handles.values()):
            try:
                ray.get(handle.__ray_ready__.remote(), timeout=10)
            except RayActorError:
                return True
            except GetTimeoutError:  # busy or slow to answer: not known to be lost
                pass
        return False

    def _condemn(self, attempt: int) -> None:
        """End group attempt `attempt` (a rank is dead): its ranks stop serving, Ray Train restarts the group."""
        with self.cv:
            if attempt == self.attempt:
                self.attempt += 1
                self.joined, self.handles, self.skip_to = set(), {}, self.seq
                self.cv.notify_all()

    def published_weights(self, checkpoint_id: str) -> list:
        """ActorWorker.published_weights on rank 0 (where the update publishes): [ref] or []."""
        got = self.call_each(
            "published_weights", [[ray.put((checkpoint_id,))]] + [None] * (self.spec["num_workers"] - 1)
        )
        ok, value = got[0][:2]
        return ray.get(value[0]) if ok is True else []

    def stop(self) -> None:
        with self.cv:
            self.ended = self.ended or "stopped"
            self.cv.notify_all()
        shutil.rmtree(self.store_dir, ignore_errors=True)


def serve_rank(config: dict) -> None:
    """Training function of every Ray Train rank: build the role's worker, join the process group, then run the
    host's commands until it says stop."""
    host = ray.get_actor(config["host"], namespace=config["namespace"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    spec = config["spec"]
    worker = spec["worker_cls"](rank, world, spec["threads"], spec["shape"], **spec["init_kwargs"])
    me = ray.get_runtime_context().current_actor
    info = ray.get(host.join.remote(rank, os.getpid(), worker.placement(), me))
    attempt, after = info["attempt"], info["after"]
    if (
        spec["process_group"]
        and world > 1
        and not _join_process_group(host, worker, rank, attempt, store_dir=info["store_dir"], local=spec["local"])
    ):
        return
    while (cmd := ray.get(host.next.remote(attempt, after))) is not None:
        after, name, arg_refs = cmd
        if arg_refs[rank] is None:  # fewer argument tuples than ranks: this rank sits the call out
            host.done.remote(attempt, rank, after, True, [ray.put(None)])
            continue
        try:
            out = getattr(worker, name)(*ray.get(arg_refs[rank][0]))
            host.done.remote(attempt, rank, after, True, [ray.put(out)])
        except Exception as exc:
            text = f"rank {rank} of the Ray Train group raised in {name}:\n{traceback.format_exc()}"
            host.done.remote(attempt, rank, after, False, [_portable(exc, text), text])


def _portable(exc: Exception, text: str) -> Any:
    """A reference to `exc` (raised again on the driver), or to a RuntimeError of `text` when it does not pickle."""
    try:
        return ray.put(exc)
    except Exception:
        return ray.put(RuntimeError(text))


def _join_process_group(host, worker, rank: int, attempt: int, *, store_dir: str, local: bool) -> bool:
    """rlake's rendezvous for this group attempt (False: a newer attempt started meanwhile; stop serving)."""
    if rank == 0:
        if local:
            init = f"file://{store_dir}/pg-{attempt}-{time.time_ns()}"
        else:
            ip, port = worker.free_address()
            init = f"tcp://{ip}:{port}"
        ray.get(host.set_rendezvous.remote(attempt, init))
    else:
        init = ray.get(host.get_rendezvous.remote(attempt))
        if init is None:
            return False
    worker.init_process_group(init)
    return True


class TrainGroup(WorkerGroup):
    """A WorkerGroup whose one handle is the TrainHost of `num_workers` Ray Train ranks (`call` is WorkerGroup's)."""

    def __init__(self, worker_cls: type, role: str, host, num_workers: int) -> None:
        super().__init__(worker_cls, role, [host])
        self._n = num_workers

    @property
    def num_workers(self) -> int:
        return self._n

    def call_each(self, method, per_rank_args) -> list:
        """method(*per_rank_args[i]) on rank i (fewer argument tuples than ranks: the first ranks only)."""
        name = _method_name(self.worker_cls, method)
        per_rank = [tuple(a) for a in per_rank_args]
        refs = [[ray.put(a)] for a in per_rank] + [None] * (self.num_workers - len(per_rank))
        results = ray.get(self.handles[0].call_each.remote(name, refs))
        if results and results[0][0] == "lost":
            raise TrainRankLostError(results[0][1], restarts_itself=results[0][2])
        failed = [v for ok, v in results if ok is False and v is not None]
        if failed:
            self.kill()  # as WorkerGroup: the failed rank's peers may wait in a collective
            exc = ray.get(failed[0][0])
            exc.add_note(failed[0][1])
            raise exc
        return [ray.get(v[0]) for _, v in results[: len(per_rank)]]

    def kill(self) -> None:
        for h in self.handles:
            try:
                ray.get(h.stop.remote(), timeout=30)
            except RayError:
                pass
            try:
                ray.kill(h, no_restart=True)
            except Exception:  # already dead
                pass
        self.handles = []


def train_group(worker_cls: type, role: str, spec: dict[str, Any]) -> TrainGroup:
    """The run's Ray Train group of `role` for spec (num_workers, threads, process_group, resources, shape,
    init_kwargs, max_failures, local): the live one when it has spec's shape, else a new one (any other group of
    the role stopped first, as `worker_group` replaces a group of another shape)."""
    found = _find(role)
    if len(found) == 1:
        try:
            if ray.get(found[0].shape.remote(), timeout=60) == spec["shape"] and ray.get(found[0].alive.remote()):
                return TrainGroup(worker_cls, role, found[0], spec["num_workers"])
        except (RayError, AttributeError) as exc:  # lost, or a WorkerGroup rank (no alive())
            log.warning(
                "%s group not reusable (%s); starting a Ray Train group", role, " ".join(str(exc).split())[:300]
            )
        TrainGroup(worker_cls, role, found[0], spec["num_workers"]).kill()
    elif found:
        WorkerGroup(worker_cls, role, found).kill()
    _kill_groups_at_exit()
    name = f"{_role_prefix(role)}{os.urandom(4).hex()}:0"
    spec = {**spec, "name": name, "role": role, "worker_cls": worker_cls}
    spec["resources"] = dict(spec["resources"] or {"CPU": TINY_CPU})
    env = {"OMP_NUM_THREADS": str(spec["threads"]), "MKL_NUM_THREADS": str(spec["threads"])}
    host = (
        ray.remote(TrainHost)
        .options(
            name=name,
            lifetime="detached",
            num_cpus=0,
            max_concurrency=4 * spec["num_workers"] + 16,
            max_restarts=0,
            runtime_env={"env_vars": env},
        )
        .remote(spec)
    )
    return TrainGroup(worker_cls, role, host, spec["num_workers"])
