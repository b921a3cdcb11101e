"""One driver per run (stages/run/lease.py): a lease in the run's storage, on a local root and on S3 (SeaweedFS).

Other drivers are other holders (another host, or a real process that exits); the lease's own create-only puts
decide who holds it. `rlake train` on a run whose lease a live driver holds exits 2 before any work, naming the
holder, since when it holds the lease, when it expires, and how to proceed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import psutil
import pytest

from pipelines.cli import main
from stages.run.lease import Holder, LeaseHeldError, LeaseLostError, RunLease


def _other_host(pid: int = 4242) -> Holder:
    return Holder("gpu-node-7", pid, 1700000000.0, "tok-other")


def _exchange(root: str, options: dict | None = None) -> None:
    """Two drivers of run `r1`: the second is refused while the first holds the lease, takes it once released."""
    first = RunLease(root, "r1", options, holder=_other_host()).acquire(renew=False)
    with pytest.raises(LeaseHeldError) as exc:
        RunLease(root, "r1", options).acquire(renew=False)
    msg = str(exc.value)
    for part in ("pid 4242 on host gpu-node-7", "holding the run's lease since", "expires at", "kill 4242"):
        assert part in msg, msg
    RunLease(root, "r2", options).acquire(renew=False).release()  # another run: its own lease
    first.release()
    second = RunLease(root, "r1", options).acquire(renew=False)
    assert second.current()[1]["holder"]["pid"] == psutil.Process().pid
    second.release()
    assert second.current()[1]["released"] is True


def _expiry(root: str, options: dict | None = None) -> None:
    """A holder that stops renewing is taken over after its ttl; it then finds its lease lost."""
    stuck = RunLease(root, "r3", options, ttl_s=1.0, holder=_other_host()).acquire(renew=False)
    stuck.renew()  # renewing works while it holds the lease
    with pytest.raises(LeaseHeldError):
        RunLease(root, "r3", options).acquire(renew=False)
    time.sleep(1.2)
    taker = RunLease(root, "r3", options).acquire(renew=False)
    with pytest.raises(LeaseLostError, match=r"taken over by pid \d+ on host"):
        stuck.renew()
    taker.release()


def test_local_root_one_driver_then_the_next(tmp_path) -> None:
    _exchange(str(tmp_path / "store"))
    _exchange(f"file://{tmp_path / 'store2'}")


def test_local_root_a_holder_that_stops_renewing_is_taken_over(tmp_path) -> None:
    _expiry(str(tmp_path / "store"))


def test_a_dead_driver_on_this_host_is_taken_over_at_once(tmp_path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = Holder.this_process()
    dead = Holder(dead.host, proc.pid, round(psutil.Process(proc.pid).create_time(), 2), "tok-dead")
    RunLease(str(tmp_path), "r4", holder=dead).acquire(renew=False)  # ttl 60 s: not expired
    with pytest.raises(LeaseHeldError):
        RunLease(str(tmp_path), "r4").acquire(renew=False)
    proc.kill()
    proc.wait()
    RunLease(str(tmp_path), "r4").acquire(renew=False).release()


def test_the_holder_renews_in_the_background(tmp_path) -> None:
    lease = RunLease(str(tmp_path), "r5", ttl_s=0.4).acquire()
    first = lease.current()[1]["expires_at"]
    time.sleep(0.6)
    assert lease.current()[1]["expires_at"] > first  # renewed, so never taken over while alive
    with pytest.raises(LeaseHeldError):
        RunLease(str(tmp_path), "r5", holder=_other_host()).acquire(renew=False)
    lease.release()


@pytest.mark.cluster
def test_s3_root_one_driver_expiry_and_takeover(s3_env) -> None:
    _exchange(s3_env.root("lease-a"), s3_env.storage_options)
    _expiry(s3_env.root("lease-b"), s3_env.storage_options)
    assert any(k.startswith("lease-a/leases/r1/") for k in s3_env.keys("lease-a/"))


def test_a_second_rlake_train_exits_2_naming_the_holder(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    held = RunLease(str(out), "busy", holder=_other_host()).acquire(renew=False)
    rc = main(["train", "--config", "configs/ci_tiny.yaml", "--run-id", "busy", f"trainer.output_dir={out}"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert re.search(r"run busy is driven by another `rlake train`: pid 4242 on host gpu-node-7", err), err
    assert "expires at" in err and "rerun" in err
    made = {p.name for p in out.iterdir()}
    assert not made & {"tables", "checkpoints", "dagster_home", "mlflow.db", "mlartifacts"}, made  # no work began
    held.release()
