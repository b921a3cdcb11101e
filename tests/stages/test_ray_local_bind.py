"""The local default Ray (ray.address=local, stages/workers/connect.py) listens on loopback only.

A fresh process (this module run as a script: ensure_ray starts a cluster only when none is connected, and
the session's shared test cluster is not the default) starts the local default with `ensure_ray("local", 2)`,
builds a real 2-rank worker group joined in a gloo process group, and lists with psutil every LISTEN socket
of itself, its descendants (GCS, raylet, agents, the workers) and any process of its Ray session. Each must
be bound to 127.0.0.1 or ::1 (IPv4-mapped ::ffff:127.0.0.1 included): without the loopback node IP, Ray
listens on every interface, and torch's TCPStore does whatever host it is given.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _listening(pids: set[int]) -> list[dict]:
    import psutil

    out = []
    for pid in sorted(pids):
        try:
            proc = psutil.Process(pid)
            conns = proc.net_connections(kind="inet")
            name = proc.name()
        except psutil.Error:  # exited meanwhile
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                out.append({"pid": pid, "name": name, "ip": c.laddr.ip, "port": c.laddr.port})
    return out


def _session_pids(session_dir: str) -> set[int]:
    """This process, its descendants, and every process whose command line names the Ray session."""
    import psutil

    me = psutil.Process()
    pids = {me.pid, *(p.pid for p in me.children(recursive=True))}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if any(session_dir in arg for arg in proc.info["cmdline"] or []):
            pids.add(proc.info["pid"])
    return pids


def main(report_path: str) -> None:
    import ray

    from stages.workers.group import Worker, ensure_ray, worker_group

    ensure_ray("local", 2)
    group = worker_group(Worker, "bindcheck", 2, process_group=True)
    placements = group.call(Worker.placement)
    session_dir = ray._private.worker._global_node.get_session_dir_path()
    report = {
        "node_ip": ray.util.get_node_ip_address(),
        "process_groups": [p["process_group"] for p in placements],
        "worker_pids": group.call(Worker.pid),
        "listening": _listening(_session_pids(session_dir)),
        "cluster_flag_after_init": os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"),
    }
    Path(report_path).write_text(json.dumps(report, indent=1))
    group.kill()
    ray.shutdown()


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


@pytest.mark.ray
def test_the_local_default_listens_on_loopback_only(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, __file__, str(report_path)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["node_ip"] == "127.0.0.1"
    assert report["process_groups"] == ["gloo", "gloo"]  # the ranks really joined a group
    assert report["cluster_flag_after_init"] is None  # the flag was scoped to the start, not left in the env
    listening = report["listening"]
    names = {s["name"] for s in listening}
    # Ray's own servers and the workers were measured, not an empty list
    assert {"gcs_server", "raylet"} <= names, listening
    assert set(report["worker_pids"]) & {s["pid"] for s in listening}, listening
    outside = [s for s in listening if not _is_loopback(s["ip"])]
    assert outside == [], f"sockets listening outside loopback: {outside}"


if __name__ == "__main__":
    main(sys.argv[1])
