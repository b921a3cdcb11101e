"""stages/io/ports.py: ports that bind now, drawn below the ephemeral range (which outgoing connections share)."""

from __future__ import annotations

import socket

from stages.io import ports


def test_ports_are_distinct_bindable_and_outside_ray_and_ephemeral_ranges() -> None:
    got = ports.free_ports(5)
    assert len(set(got)) == 5
    low = ports._ephemeral_low()
    for port in got:
        assert ports.LOW <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_returned(monkeypatch) -> None:
    # With the range narrowed to the 30 ports starting at a port held open here, that port is never drawn.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "LOW", taken)
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: taken + 30)
        got = ports.free_ports(5)
        assert taken not in got and len(set(got)) == 5


def test_falls_back_to_kernel_ports_when_the_range_is_too_small(monkeypatch) -> None:
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: ports.LOW + 3)
    got = ports.free_ports(4)
    assert len(set(got)) == 4
    for port in got:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
