"""Free TCP ports that stay free until the process that asked binds them.

A port from `bind(("", 0))` comes from the kernel's ephemeral range, which every outgoing connection on the
machine also draws from: between closing the probe socket and the real bind (a gloo TCPStore, a server
start), a Ray or gRPC client may take it, and the bind fails with EADDRINUSE. Ports below the ephemeral
range (and above Ray's worker ports, 10002-19999 by default) are only ever taken by an explicit bind, so a
random one that binds now is very unlikely to be taken in that window.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOW = 20000
"""Above Ray's default worker ports (10002-19999)."""
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux), 32768 where it cannot be read."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _binds(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports that bind on `host` now, drawn at random from [20000, ephemeral range start).

    Falls back to kernel-assigned ports when that range is empty or exhausted (a machine whose ephemeral
    range starts low).
    """
    high = _ephemeral_low()
    rng = random.SystemRandom()
    chosen: list[int] = []
    if high - LOW > 4 * n:
        for _ in range(200 * n):
            port = rng.randrange(LOW, high)
            if port not in chosen and _binds(host, port):
                chosen.append(port)
                if len(chosen) == n:
                    return chosen
    return chosen + _kernel_ports(n - len(chosen), host, exclude=chosen)


def _kernel_ports(n: int, host: str, exclude: list[int]) -> list[int]:
    """`n` distinct kernel-assigned ports not in `exclude` (all held open together so none repeats)."""
    socks = []
    try:
        while len(socks) < n:
            s = socket.socket()
            s.bind((host, 0))
            if s.getsockname()[1] in exclude:
                s.close()
                continue
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One port that binds on `host` now (see free_ports)."""
    return free_ports(1, host)[0]
