"""How a process of a run connects to Ray (`ensure_ray`), and the run's Ray settings the worker groups read.

`ray.address` (configs/schema.py RayConfig):
- `local` (the default): a new Ray cluster of this process, never an attach to a `ray start` cluster on the
  machine. Everything it opens listens on loopback only: Ray's GCS, raylet, object manager, agents and
  workers (the node IP is 127.0.0.1: Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 for that, the only switch
  that works, because `ray.init(_node_ip_address="127.0.0.1")` is rewritten to the NIC address), and the
  torch process groups (stages/workers/group.py: a FileStore instead of a TCPStore, which listens on every
  interface, and GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME = the loopback interface).
- `auto`, `host:port`, `ray://host:port`: attach to that cluster. Anything that is not loopback-only
  requires Ray's token auth (RAY_AUTH_MODE=token and the token, RAY_AUTH_TOKEN or ~/.ray/auth_token, in
  this process's environment), refused before connecting otherwise: a cluster without it runs any code
  anyone on its network sends. A `127.0.0.1:port` cluster (the tests' multi-node cluster on one machine) is
  reachable from this machine only, and allowed without.

Ray 2.60's own defaults: a new local cluster (`ray.init()` / `address="local"`) turns token auth on when
RAY_AUTH_MODE is unset (it sets RAY_AUTH_MODE=token in this process's environment and writes a token to
~/.ray/auth_token if none exists; "Token authentication is enabled for this Ray cluster"); `ray start --head`
turns it on only when a token already exists; a driver attaching by an explicit address never turns it on
by itself. So a cluster's head, its nodes and every driver must all be given RAY_AUTH_MODE=token.

`ray.runtime_env` is the job's runtime_env (`ray.init(runtime_env=...)`), so it reaches every actor and task
of the run (Ray merges an actor's own env_vars into it, as the worker groups' thread variables are). The
values of `env_vars_from: [NAME, ...]` (storage credentials) are read here from this process's environment (a
missing one is an error) and set in each worker process when it starts by a `worker_process_setup_hook`
(`WorkerEnv`), never put in the runtime_env's env_vars: Ray writes env_vars in plain text to every node's
runtime_env_agent.log and the job's record, while the hook travels pickled in the GCS and only its key is
logged (tests/cluster greps every node's Ray logs for the secrets). HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE
(not secret) are forwarded as env_vars when set. Under `ray job submit --runtime-env-json`, Ray merges the two
and refuses a field set in both.

The run's settings (`RaySettings`: run id, local or cluster, ray.resources_per_worker) are recorded by the
`ensure_ray` call that connects (one per process: one run per process), so the stages' `worker_group(...)`
calls need no extra argument; a process that called `ray.init` itself (tests) gets the defaults (a local
run, no run id, no per-role resources) unless it calls `configure`.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psutil
import ray

from configs.schema import RunConfig

log = logging.getLogger(__name__)

NO_RUN = "-"
"""The run part of worker names when no run was given (a run id never starts with '-')."""
LOCAL_NAMESPACE = "rlake"
CLUSTER_FLAG = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""0: Ray takes 127.0.0.1 as the node IP (ray._private.services.get_node_ip_address), so it binds loopback."""
FORWARDED_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
"""Driver environment variables every worker gets when they are set (no download on a node)."""


@dataclass(frozen=True)
class RaySettings:
    """What the worker groups of this process need to know about the run (set by ensure_ray)."""

    run_id: str = NO_RUN
    local: bool = True
    """A local cluster of this process (loopback only, process groups on a FileStore)."""
    resources_per_worker: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    """ray.resources_per_worker: the roles placed in a placement group of their own."""
    placement_timeout_s: float = 60.0
    """ray.placement_timeout_s: the longest a worker group's placement group may wait for nodes."""


_settings = RaySettings()


def settings() -> RaySettings:
    """The settings of the ensure_ray call that connected this process (defaults before any)."""
    return _settings


def configure(run: RaySettings) -> None:
    """Record the run's settings (ensure_ray does, when it connects): for a process that connected to Ray
    itself (a test's ray.init) and then builds a run's worker groups. Groups already built keep their names."""
    global _settings
    _settings = run


def is_local(address: str | None) -> bool:
    return address in (None, "local")


def namespace_for(address: str | None, run_id: str | None) -> str:
    """`rlake` on a local cluster (one process, one run); `rlake:<run>` on a shared one, so each run's named
    workers and placement groups (the GPU pool's included) are its own and every process of the run finds them."""
    return LOCAL_NAMESPACE if is_local(address) or not run_id else f"{LOCAL_NAMESPACE}:{run_id}"


def is_loopback_address(address: str) -> bool:
    """True for `127.x.x.x:port`, `[::1]:port`, `localhost:port` (also behind `ray://`)."""
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name, or "auto"
        return False


def check_cluster_auth(address: str, environ: Mapping[str, str] = os.environ) -> None:
    """Refuse to attach to a cluster reachable from other machines without Ray's token auth."""
    if is_local(address) or is_loopback_address(address):
        return
    mode = environ.get("RAY_AUTH_MODE")
    if (mode or "").lower() != "token":
        raise ValueError(
            f"ray.address={address!r} attaches to a Ray cluster, but RAY_AUTH_MODE is {mode!r}, not 'token': "
            "without token auth anyone who can reach the cluster's ports can run code on it and read the run's "
            "credentials. Start the head and every node with RAY_AUTH_MODE=token (and the same RAY_AUTH_TOKEN), "
            "export RAY_AUTH_MODE=token and RAY_AUTH_TOKEN here too, then rerun (docs/cluster.md); or train on a "
            "new local cluster with ray.address=local."
        )


class WorkerEnv:
    """Ray's worker_process_setup_hook of a run: sets `values` (env_vars_from's variables) in os.environ of each
    worker process when it starts, before any task runs. Its repr names the variables only."""

    def __init__(self, values: Mapping[str, str]) -> None:
        self.values = dict(values)
        self.__name__ = "set_worker_env"  # Ray records the hook by this name

    def __call__(self) -> None:
        os.environ.update(self.values)

    def __repr__(self) -> str:
        return f"WorkerEnv({sorted(self.values)})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WorkerEnv) and other.values == self.values


def resolve_runtime_env(runtime_env: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """ray.runtime_env as Ray takes it: `env_vars_from` read from `environ` into a WorkerEnv setup hook (and
    dropped), HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE forwarded as env_vars when set, every env_vars value a
    string. No value of env_vars_from is put in env_vars, which Ray logs."""
    env = dict(runtime_env)
    names = env.pop("env_vars_from", None) or []
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ValueError(
            f"ray.runtime_env.env_vars_from={names!r} must be a list of environment variable names, because each "
            "is copied from the driver's environment to every worker; write e.g. "
            "[AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY]"
        )
    missing = [n for n in names if n not in environ]
    if missing:
        raise ValueError(
            f"ray.runtime_env.env_vars_from names {missing}, which this process's environment does not have: they "
            "are copied from here to every Ray worker (storage credentials, HF_HUB_OFFLINE), so a worker would run "
            f"without them; export {' '.join(f'{n}=...' for n in missing)} before launching, or drop them from "
            "env_vars_from."
        )
    given = {k: str(v) for k, v in (env.get("env_vars") or {}).items()}
    both = sorted(set(given) & set(names))
    if both:
        raise ValueError(
            f"ray.runtime_env sets {both} both in env_vars and in env_vars_from, so their value is ambiguous; keep "
            "each variable in one of the two."
        )
    if names and "worker_process_setup_hook" in env:
        raise ValueError(
            "ray.runtime_env sets worker_process_setup_hook and env_vars_from, but env_vars_from is delivered by "
            "rlake's own setup hook (so that no secret reaches Ray's logs); set those variables from your hook, or "
            "drop it and keep env_vars_from."
        )
    forwarded = {n: environ[n] for n in FORWARDED_ENV if n in environ and n not in names}
    env_vars = {**forwarded, **given}
    if env_vars:
        env["env_vars"] = env_vars
    if names:
        env["worker_process_setup_hook"] = WorkerEnv({n: environ[n] for n in names})
    return env


def loopback_interface() -> str:
    """The name of the network interface holding 127.0.0.1 (`lo` on Linux, `lo0` on macOS)."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addrs):
            return name
    return "lo"


def local_env_vars(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The collective libraries' interface on a local cluster: loopback, unless this environment names one."""
    lo = loopback_interface()
    return {k: environ.get(k, lo) for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}


@contextmanager
def _loopback_node() -> Iterator[None]:
    """While a local cluster starts: node IP 127.0.0.1 for this process (the flag Ray read at import) and for
    the Ray processes it spawns (they inherit the environment, and so do the workers the raylet starts)."""
    from ray._private import ray_constants  # noqa: PLC0415 - the flag Ray's node-IP lookup reads

    before_env, before_flag = os.environ.get(CLUSTER_FLAG), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[CLUSTER_FLAG], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    try:
        yield
    finally:  # a later attach to a real cluster in this process must see the NIC address again
        ray_constants.ENABLE_RAY_CLUSTER = before_flag
        if before_env is None:
            os.environ.pop(CLUSTER_FLAG, None)
        else:
            os.environ[CLUSTER_FLAG] = before_env


def ensure_ray(
    address: str | None = "local",
    num_cpus: int | None = None,
    *,
    run_id: str | None = None,
    runtime_env: Mapping[str, Any] | None = None,
    resources_per_worker: Mapping[str, Mapping[str, float]] | None = None,
    placement_timeout_s: float = 60.0,
) -> None:
    """Connect this process to Ray once (see the module docstring) and record the run's settings; a no-op when
    connected (the settings stay those of the call that connected, or of `configure`).

    address: ray.address (`local`/None: a new loopback-only cluster with num_cpus CPUs, None = all).
    run_id: names the run's workers and placement groups (and, on a cluster, its namespace).
    runtime_env: ray.runtime_env, resolved here (resolve_runtime_env); applied only when this call connects.
    resources_per_worker: ray.resources_per_worker (stages/workers/placement.py role_placement_group).
    placement_timeout_s: ray.placement_timeout_s (a placement group not placed by then fails the stage)."""
    if ray.is_initialized():
        return
    configure(
        RaySettings(
            run_id=run_id or NO_RUN,
            local=is_local(address),
            resources_per_worker={r: dict(v) for r, v in (resources_per_worker or {}).items()},
            placement_timeout_s=placement_timeout_s,
        )
    )
    os.environ.setdefault("RAY_ACCEPT_CLOUD_SDK_WARNING", "1")
    check_cluster_auth(address or "local")
    env = resolve_runtime_env(runtime_env or {})
    kwargs: dict[str, Any] = {
        "include_dashboard": False,
        "log_to_driver": False,
        "configure_logging": False,
        "namespace": namespace_for(address, run_id),
    }
    if not is_local(address):
        ray.init(address=address, runtime_env=env or None, **kwargs)
        return
    env["env_vars"] = {**local_env_vars(), **env.get("env_vars", {})}
    with _loopback_node():
        ray.init(address="local", num_cpus=num_cpus, runtime_env=env, _node_ip_address="127.0.0.1", **kwargs)


def ensure_ray_for(cfg: RunConfig) -> None:
    """ensure_ray with run config `cfg`'s ray.* and run id: what every driver-side entry point (a stage, replay,
    the CLI) calls, so a cluster run's workers get its runtime_env (forwarded credentials) and placement."""
    ensure_ray(
        cfg.ray.address,
        cfg.ray.num_cpus,
        run_id=cfg.run_id,
        runtime_env=cfg.ray.runtime_env,
        resources_per_worker=cfg.ray.resources_per_worker,
        placement_timeout_s=cfg.ray.placement_timeout_s,
    )
