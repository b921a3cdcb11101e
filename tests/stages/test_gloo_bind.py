"""A worker group's process group on a cluster listens on the node IP Ray reports, never on every interface.

Two real ranks (spawned processes, as two Ray workers would be) join through the TCP rendezvous the cluster path
of stages/workers/group.py uses (rank 0's `free_address`, then `init_process_group("tcp://...")`), all-reduce
over gloo, and list their LISTEN sockets with psutil: the TCPStore's and gloo's. torch's TCPStore listens on
`::` whatever host it is given; rlake binds its socket to the node IP itself (stages/workers/rendezvous.py).
"""

from __future__ import annotations

import multiprocessing as mp

import pytest


def _rank(rank: int, addr_q, out_q) -> None:
    import os

    import psutil
    import torch
    import torch.distributed as dist

    from stages.workers.group import Worker

    os.environ.pop("GLOO_SOCKET_IFNAME", None)  # the interface must come from the node IP
    worker = Worker(rank, 2, 1)
    if rank == 0:
        ip, port = worker.free_address()
        addr_q.put((ip, port))
        addr_q.put((ip, port))
    ip, port = addr_q.get(timeout=60)
    worker.init_process_group(f"tcp://{ip}:{port}")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    conns = psutil.Process().net_connections(kind="inet")
    listening = sorted({c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN})
    out_q.put({"rank": rank, "ip": ip, "sum": float(t.item()), "listening": listening})
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.ray
def test_tcp_rendezvous_listens_on_the_node_ip_only() -> None:
    ctx = mp.get_context("spawn")
    addr_q, out_q = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, addr_q, out_q)) for r in (0, 1)]
    for p in procs:
        p.start()
    reports = sorted((out_q.get(timeout=120) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join(timeout=60)
    assert [r["sum"] for r in reports] == [3.0, 3.0]  # the ranks really formed a group
    node_ip = reports[0]["ip"]
    assert reports[0]["listening"], reports  # rank 0's store was measured
    for r in reports:
        assert set(r["listening"]) <= {node_ip}, f"rank {r['rank']} listens outside {node_ip}: {r['listening']}"
