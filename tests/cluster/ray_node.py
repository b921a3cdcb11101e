"""One Ray node on 127.0.0.1, as a process of its own: `python tests/cluster/ray_node.py --head|--address A`.

`ray start --address` rewrites 127.0.0.1 to the machine's NIC address, so the cluster tests start nodes
through Ray's node API, as `ray.cluster_utils` does, each inside its own mount namespace (tests/cluster/
ray_cluster.py). The node writes its GCS address to --ready-file once it is up, then stays until SIGTERM,
when it shuts its Ray processes down.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--head", action="store_true")
    ap.add_argument("--address", default=None, help="the head's GCS address (worker nodes)")
    ap.add_argument("--port", type=int, default=0, help="the head's GCS port")
    ap.add_argument("--num-cpus", type=int, default=1)
    ap.add_argument("--resources", default="{}", help="custom resources, JSON")
    ap.add_argument("--temp-dir", required=True)
    ap.add_argument("--ready-file", required=True)
    args = ap.parse_args()

    # a worker node registers with the GCS within raylet_start_wait_time_s (Ray's default 30 s); on a 2-core box
    # whose other test worker is busy that wait ran out once ("GCS cannot find the node"): give it 120 s
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")
    import ray
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    params = RayParams(
        node_ip_address="127.0.0.1",
        num_cpus=args.num_cpus,
        num_gpus=0,
        resources=json.loads(args.resources),
        object_store_memory=200 * 1024 * 1024,
        min_worker_port=0,
        max_worker_port=0,
        temp_dir=args.temp_dir,
        include_dashboard=False,
    )
    if args.head:
        params.update(gcs_server_port=args.port or None)
    else:
        params.update(gcs_address=args.address, include_log_monitor=False, node_manager_port=0)
        params.dashboard_agent_listen_port = None
    node = Node(params, head=args.head, shutdown_at_exit=True, spawn_reaper=True)

    def stop(*_):
        node.kill_all_processes(check_alive=False, allow_graceful=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    Path(args.ready_file).write_text(json.dumps({"gcs_address": node.gcs_address, "node_id": node.node_id}))
    del ray
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
