"""A multi-node Ray cluster on one machine where no node can read another's local disk.

Each node (head included) is `tests/cluster/ray_node.py` started inside `unshare -m` with a private tmpfs
mounted over /tmp (where pytest keeps the driver's output directory) and over the checkpoint cache, so a
path handed from the driver to a node, or from one node to another, fails as it would across machines. The
driver (the test's `rlake train` subprocess) runs outside every namespace: it is the user's machine.

Everything listens on 127.0.0.1 (the node API with node_ip_address=127.0.0.1; `ray start --address` would
rewrite loopback), token auth is on for every process (RAY_AUTH_MODE=token with one RAY_AUTH_TOKEN), and
nodes are stopped by process id, never `ray stop`. A node's local disk can be listed from outside through
/proc/<pid>/root, which resolves paths in that process's mount namespace.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from stages.io.ports import free_ports
from tests.servers import stop_pid

NODE_SCRIPT = Path(__file__).with_name("ray_node.py")
ROOT = Path(__file__).resolve().parents[2]
HIDDEN = ("/tmp",)
"""Paths every node gets a private tmpfs over (the driver's output dir lives under /tmp)."""


@dataclass
class RayNode:
    name: str
    proc: subprocess.Popen
    log: Path
    node_id: str = ""

    def local_files(self, under: str = "/tmp") -> list[str]:
        """Files on this node's private disk under `under` (its tmpfs), Ray's own session dir left out."""
        base = Path(f"/proc/{self.proc.pid}/root{under}")
        out = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if d != "ray"]
            out += [str(Path(dirpath, f))[len(str(base)) :] for f in filenames]
        return sorted(out)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """Stop the node by its process group (the node script kills its raylet et al. on SIGTERM)."""
        stop_pid(self.proc, grace_s=15)

    def lose(self) -> list[int]:
        """Lose the node as a crash or power cut would: SIGKILL at once every process in its mount namespace (the
        node script, raylet, object store, workers), so nothing unregisters and Ray learns of it only through its
        health checks. Returns the pids killed (all started by this test, found by namespace, not by name)."""
        ns = os.readlink(f"/proc/{self.proc.pid}/ns/mnt")
        if ns == os.readlink("/proc/self/ns/mnt"):
            raise RuntimeError(f"node {self.name} shares this test's mount namespace: its processes are not its own")
        pids = [pid for pid in _pids() if _mount_ns(pid) == ns]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)
        return pids


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _mount_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:  # gone, or not ours to read
        return None


@dataclass
class RayCluster:
    workdir: Path
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    nodes: list[RayNode] = field(default_factory=list)
    gcs_address: str = ""

    @property
    def env(self) -> dict[str, str]:
        """What every process of the cluster, and its driver, needs in its environment."""
        return {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "GLOO_SOCKET_IFNAME": "lo",
            "RAY_ACCEPT_CLOUD_SDK_WARNING": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONPATH": str(ROOT),
        }

    def _start(self, name: str, args: list[str], extra_env: dict[str, str] | None) -> RayNode:
        if shutil.which("unshare") is None:
            raise RuntimeError("`unshare` (util-linux) is missing: the cluster tests isolate each node's disk with it")
        for path in (sys.executable, str(ROOT)):
            if any(path == h or path.startswith(h + "/") for h in HIDDEN):
                raise RuntimeError(
                    f"{path} is under {HIDDEN}, which every test node hides behind a private tmpfs (its own disk), "
                    "so the node could not see the interpreter or the code: clone and make the virtualenv elsewhere "
                    "(e.g. /work/rlake or $HOME/rlake)"
                )
        log = self.workdir / f"{name}.log"
        mounts = " && ".join(f"mount -t tmpfs tmpfs {p}" for p in HIDDEN)
        node_cmd = " ".join(
            [sys.executable, str(NODE_SCRIPT), *args, "--temp-dir", "/tmp/ray", "--ready-file", "/dev/stdout"]
        )
        cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", f"{mounts} && exec {node_cmd}"]
        env = {**os.environ, **self.env, **(extra_env or {})}
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
            )
        node = RayNode(name, proc, log)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            for line in log.read_text(errors="replace").splitlines():
                if line.startswith('{"gcs_address"'):
                    info = json.loads(line)
                    node.node_id = info["node_id"]
                    self.gcs_address = self.gcs_address or info["gcs_address"]
                    self.nodes.append(node)
                    return node
            if proc.poll() is not None:
                break
            time.sleep(0.3)
        stop_pid(proc)
        raise RuntimeError(f"Ray node {name} did not start; its log:\n{log.read_text(errors='replace')[-4000:]}")

    def start_head(self, num_cpus: int = 0, resources: dict[str, float] | None = None) -> RayNode:
        self.workdir.mkdir(parents=True, exist_ok=True)
        (port,) = free_ports(1)
        return self._start(
            "head",
            [
                "--head",
                "--port",
                str(port),
                "--num-cpus",
                str(num_cpus),
                "--resources",
                f"'{json.dumps(resources or {})}'",
            ],
            None,
        )

    def add_node(self, name: str, num_cpus: int, resources: dict[str, float] | None = None) -> RayNode:
        return self._start(
            name,
            [
                "--address",
                self.gcs_address,
                "--num-cpus",
                str(num_cpus),
                "--resources",
                f"'{json.dumps(resources or {})}'",
            ],
            None,
        )

    def node(self, name: str) -> RayNode:
        return next(n for n in self.nodes if n.name == name)

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.kill()
