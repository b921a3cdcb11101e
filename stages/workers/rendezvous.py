"""The TCP rendezvous of a worker group's process group on a cluster, bound to the node IP Ray reports.

torch's TCPStore listens on every interface (`::`) whatever host it is given, and gloo picks its interface from
the host name when GLOO_SOCKET_IFNAME is unset. So rank 0 binds a listening socket to its node IP itself
(`listener`) and hands its file descriptor to the store (`master_listen_fd`), and each rank pins the collective
libraries to the interface that holds its node IP (`pin_interfaces`) unless the environment names one. Nothing
of a group listens on 0.0.0.0. The local default needs none of this (a FileStore, loopback:
stages/workers/group.py `_rendezvous`).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import psutil
import torch.distributed as dist

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def listener(ip: str) -> socket.socket:
    """A TCP socket listening on `ip` at a port the kernel picks (no probe-then-bind race)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((ip, 0))
    sock.listen(128)
    return sock


def interface_of(ip: str) -> str | None:
    """The name of the network interface holding address `ip` (None: no interface holds it)."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%", 1)[0] == ip for a in addrs):
            return name
    return None


def pin_interfaces(node_ip: str, environ=os.environ) -> None:
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME = the interface of this node's IP, where not set already."""
    name = interface_of(node_ip)
    if name is not None:
        for var in IFNAME_VARS:
            environ.setdefault(var, name)


def tcp_store(init_method: str, rank: int, world: int, listening: socket.socket | None, timeout: timedelta):
    """The group's TCPStore at `tcp://host:port`: the server on `listening` (rank 0's socket from `listener`,
    whose descriptor the store takes over), a client elsewhere."""
    host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
    fd = listening.detach() if listening is not None else None
    return dist.TCPStore(
        host.strip("[]"), int(port), world, is_master=fd is not None, timeout=timeout, master_listen_fd=fd
    )
