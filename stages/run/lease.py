"""One driver per run: the lease `rlake train` holds in the run's storage while it works on a run id.

Two drivers of one run would interleave iterations, re-materialize each other's checkpoints and fail each other's
Dagster runs as stale, so `rlake train` takes the run's lease before any work (pipelines/runner.py) and a second
one exits 2, naming the holder and when its lease expires.

Where: `<storage root>/leases/<run_id>/<generation>.json`, through stages/io/objects.py, so the same calls work on
file:// and s3:// (the root tables and checkpoints live under). Each generation is written with a create-only put
(`If-None-Match: *` on S3, O_EXCL locally): of two drivers taking generation g at once, one wins. Local stores
have no compare-and-swap on an existing key (object_store's PutMode::Update is S3-only), hence a new key per
taking instead of one key updated in place.

A record holds the holder (host, pid, process start time, a random token), since when it holds the lease, when it
last renewed it, and when the lease expires (renewal + ttl). A background thread renews every ttl/4 by
overwriting its own generation, after checking that no newer generation exists; a driver that finds one has lost
the lease (it stopped renewing for longer than ttl and another took over): it logs why and interrupts its main
thread, so it stops writing. The newest generation can be taken (a new generation created) when it is released
(a clean exit), expired (its holder stopped renewing: killed, hung, its host gone), or held by a process known
dead on this host (a pid that no longer runs, or now runs another process): a crashed driver is replaced at once
on its own host, after ttl elsewhere.
"""

from __future__ import annotations

import _thread
import atexit
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass

import psutil

from configs.schema import RunConfig
from stages.io import objects, uris

log = logging.getLogger(__name__)

PREFIX = "leases"
TTL_S = 60.0
"""Seconds a lease lives without a renewal (RLAKE_LEASE_TTL_S overrides); the holder renews every ttl/4."""
TTL_ENV = "RLAKE_LEASE_TTL_S"
_HELD: dict[tuple[str, str], RunLease] = {}
"""The leases this process holds, by (root, run id)."""


class LeaseHeldError(FileExistsError):
    """The run's lease is held by a live driver (the CLI exits 2 with this message)."""


class LeaseLostError(RuntimeError):
    """This driver's lease was taken over by another driver."""


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


@dataclass(frozen=True)
class Holder:
    """The process holding a lease; `token` tells two takings by one process apart."""

    host: str
    pid: int
    started: float
    token: str

    @classmethod
    def this_process(cls) -> Holder:
        me = psutil.Process()
        return cls(socket.gethostname(), me.pid, round(me.create_time(), 2), uuid.uuid4().hex[:12])

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host} (process started {_utc(self.started)})"

    def same_process(self, other: Holder) -> bool:
        return (self.host, self.pid, self.started) == (other.host, other.pid, other.started)

    def gone(self) -> str | None:
        """Why this holder is known dead (only judged on its own host), else None."""
        if self.host != socket.gethostname():
            return None
        try:
            proc = psutil.Process(self.pid)
            started, zombie = proc.create_time(), proc.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return f"its holder, {self.describe()}, has exited"
        except psutil.AccessDenied:
            return None
        if zombie or abs(started - self.started) > 1.0:
            return f"its holder, {self.describe()}, has exited"
        return None


class RunLease:
    """The lease of run `run_id` under storage root `root` (file://, a path, or s3:// with `options`)."""

    def __init__(
        self,
        root: str,
        run_id: str,
        options: dict[str, str] | None = None,
        *,
        ttl_s: float | None = None,
        holder: Holder | None = None,
    ) -> None:
        self.root, self.run_id = uris.normalize(root), run_id
        self.store = objects.open_store(self.root, options)
        self.ttl_s = float(ttl_s or os.environ.get(TTL_ENV) or TTL_S)
        self.holder = holder or Holder.this_process()
        self.generation: int | None = None
        self.since = 0.0
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_config(cls, cfg: RunConfig, **kwargs) -> RunLease:
        """The lease of cfg's run under storage.root (else trainer.output_dir) with storage.options."""
        return cls(uris.storage_root(cfg), cfg.run_id, uris.storage_options(cfg), **kwargs)

    # -- records -------------------------------------------------------------------------------------------
    def _key(self, generation: int) -> str:
        return f"{PREFIX}/{self.run_id}/{generation:010d}.json"

    def _generations(self) -> list[int]:
        names = objects.list_prefixes(self.store, f"{PREFIX}/{self.run_id}/")
        return sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())

    def _read(self, generation: int) -> dict | None:
        data = objects.get_bytes(self.store, self._key(generation))
        return json.loads(data) if data else None

    def _record(self, now: float, *, released: bool = False) -> bytes:
        record = {
            "run_id": self.run_id,
            "holder": asdict(self.holder),
            "since": self.since,
            "renewed_at": now,
            "expires_at": now if released else now + self.ttl_s,
            "ttl_s": self.ttl_s,
            "released": released,
        }
        return json.dumps(record).encode()

    def current(self) -> tuple[int, dict] | None:
        """The newest generation and its record (None: never held)."""
        for generation in reversed(self._generations()):
            record = self._read(generation)
            if record is not None:
                return generation, record
        return None

    def _free(self, record: dict) -> str | None:
        """Why the lease in `record` can be taken, or None while a live driver holds it."""
        holder = Holder(**record["holder"])
        if record.get("released"):
            return f"released by {holder.describe()} at {_utc(record['renewed_at'])}"
        if time.time() > record["expires_at"]:
            return f"expired at {_utc(record['expires_at'])}: {holder.describe()} stopped renewing it"
        if holder.same_process(self.holder):
            return "held by this process"
        return holder.gone()

    # -- taking, renewing, releasing ----------------------------------------------------------------------
    def acquire(self, *, renew: bool = True) -> RunLease:
        """Take the run's lease and (renew=True) keep renewing it until `release`, also run at exit;
        LeaseHeldError while a live driver holds it."""
        earlier = _HELD.get((self.root, self.run_id))
        if earlier is not None and earlier.holder.same_process(self.holder):
            earlier.release()  # this process took it before and did not release it: that one stops renewing first
        for _ in range(5):  # a driver taking the same generation at once wins it: look again
            cur = self.current()
            why = "no driver held it" if cur is None else self._free(cur[1])
            if why is None:
                raise LeaseHeldError(self._held_message(*cur))
            generation, now = (0 if cur is None else cur[0] + 1), time.time()
            self.since = now
            try:
                objects.put_bytes(self.store, self._key(generation), self._record(now), create=True)
            except objects.AlreadyExists:
                continue
            if max(self._generations()) != generation:  # a stale taker behind us: let the newest win
                continue
            self.generation = generation
            for old in self._generations():
                if old < generation - 1:
                    objects.delete_prefix(self.store, self._key(old))
            log.info("took the lease of run %s (generation %d; it was %s)", self.run_id, generation, why)
            _HELD[(self.root, self.run_id)] = self
            if renew:
                self._start_renewing()
            return self
        raise LeaseHeldError(f"run {self.run_id}: another driver took its lease at the same time; rerun to see which")

    def _held_message(self, generation: int, record: dict) -> str:
        holder, ttl = Holder(**record["holder"]), record["ttl_s"]
        where = uris.join(self.root, self._key(generation))
        return (
            f"run {self.run_id} is driven by another `rlake train`: {holder.describe()}, holding the run's lease "
            f"since {_utc(record['since'])}, last renewed {_utc(record['renewed_at'])}; the lease expires at "
            f"{_utc(record['expires_at'])} unless renewed (every {ttl / 4:.0f}s). Two drivers of one run would "
            "interleave its iterations and checkpoints. Wait for that driver to finish, or stop it (kill "
            f"{holder.pid} on {holder.host}; a killed driver stops renewing and its lease expires after {ttl:.0f}s, "
            f"at once for a driver on this host), then rerun; or train under another --run-id. Lease: {where}"
        )

    def renew(self) -> None:
        """Extend this driver's lease by ttl; LeaseLostError when another driver has taken it over."""
        if self.generation is None:
            raise LeaseLostError(f"run {self.run_id}: this process holds no lease to renew")
        newer = [g for g in self._generations() if g > self.generation]
        record = self._read(self.generation)
        if newer or record is None or record["holder"]["token"] != self.holder.token:
            taker = self._read(newer[-1]) if newer else None
            who = Holder(**taker["holder"]).describe() if taker else "another driver (or an operator removed it)"
            raise LeaseLostError(
                f"the lease of run {self.run_id} was taken over by {who}: this driver did not renew it within "
                f"{self.ttl_s:.0f}s; stopping so that two drivers never write the run at once"
            )
        objects.put_bytes(self.store, self._key(self.generation), self._record(time.time()))

    def _start_renewing(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew_loop, name=f"rlake-lease-{self.run_id}", daemon=True)
        self._thread.start()
        atexit.register(self.release)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                self.renew()
            except LeaseLostError as exc:
                self.lost = str(exc)
                log.error("%s", exc)
                _thread.interrupt_main()  # the main thread stops with KeyboardInterrupt: the run ends KILLED
                return
            except Exception as exc:  # storage unreachable for a moment: the next tick tries again
                log.warning("could not renew the lease of run %s (retrying): %s", self.run_id, exc)

    def release(self) -> None:
        """Stop renewing and mark the lease released (a no-op when not held, lost, or already released)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        if self.generation is None or self.lost:
            return
        generation, self.generation = self.generation, None
        if _HELD.get((self.root, self.run_id)) is self:
            del _HELD[(self.root, self.run_id)]
        if max(self._generations(), default=-1) == generation:
            objects.put_bytes(self.store, self._key(generation), self._record(time.time(), released=True))
        atexit.unregister(self.release)
