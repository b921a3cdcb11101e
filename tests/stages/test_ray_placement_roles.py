"""Per-role placement from ray.resources_per_worker, ray.runtime_env forwarding, token auth, and `gc_run`.

Pure checks (no Ray): what each rank of a named role requests, the conflict with the GPU pool, the threads
of a bundle, the runtime_env expansion, and the token-auth refusal. Then real Ray, each in a fresh process
(this module run as a script, so ensure_ray starts the cluster with the run's settings):
- `local`: ensure_ray("local", 5) with actor {CPU: 2} x 2 ranks and rollout {CPU: 1} x 1: each role's PACK
  placement group `rlake:<run>:<role>` holds its bundles, rank i sits in bundle i, torch threads = the
  bundle's CPUs, the actor ranks share a gloo group, env_vars_from reaches actors and tasks; a new
  resources_per_worker rebuilds the group in a new placement group; gc_run removes the run's workers and
  groups;
- `nodes`: ray.cluster_utils.Cluster with 2 nodes on 127.0.0.1, each with a custom resource: each role lands
  on the node its bundle names, its ranks over TCP (a cluster run); the workers outlive nothing but are
  kept at the driver's exit on a cluster, and gc_run removes them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.cli import main as main_cli
from stages.workers.connect import (
    WorkerEnv,
    check_cluster_auth,
    is_loopback_address,
    namespace_for,
    resolve_runtime_env,
)
from stages.workers.placement import (
    CPU_ONLY,
    GpuPool,
    RankPlacement,
    bundle_of,
    bundle_threads,
    rank_placements,
    role_group_name,
)

ROOT = Path(__file__).resolve().parents[2]
SECRET = "RLAKE_TEST_FORWARDED_SECRET"


def test_a_named_role_gets_one_bundle_per_rank_in_rank_order() -> None:
    got = rank_placements(CPU_ONLY, "actor", 3, resources={"CPU": 2, "trainer_node": 0.5}, group="rlake:r:actor")
    bundle = (("CPU", 2.0), ("trainer_node", 0.5))
    assert got == [RankPlacement(0.0, None, 0, i, bundle, "rlake:r:actor") for i in range(3)]
    assert [p.placement_group for p in got] == ["rlake:r:actor"] * 3
    assert role_group_name("r", "actor") == "rlake:r:actor"
    # an unnamed role keeps today's placement: nothing requested
    assert rank_placements(CPU_ONLY, "actor", 2) == [RankPlacement(), RankPlacement()]


def test_a_named_role_on_a_gpu_run_must_request_its_gpu() -> None:
    with pytest.raises(ValueError, match=r"ray.resources_per_worker.actor=\{'CPU': 4\} requests no GPU"):
        rank_placements(GpuPool(2, 1), "actor", 2, resources={"CPU": 4})
    # with its own GPU the named role wins: its own placement group, not the pool's
    got = rank_placements(GpuPool(2, 1), "actor", 2, resources={"CPU": 4, "GPU": 1}, group="rlake:r:actor")
    assert [(p.pool, p.num_gpus, p.placement_group) for p in got] == [(None, 1.0, "rlake:r:actor")] * 2


def test_threads_are_the_bundle_cpus() -> None:
    assert bundle_threads({"CPU": 4}, default=1) == 4
    assert bundle_threads({"CPU": 0.5}, default=3) == 1  # a share of a CPU still runs one thread
    assert bundle_threads({"node_a": 1}, default=3) == 3  # no CPU named: the stage's own choice
    assert bundle_of({"CPU": 1, "GPU": 0}) == {"CPU": 1.0}
    with pytest.raises(ValueError, match="count nothing"):
        bundle_of({"CPU": 0})


def test_runtime_env_copies_named_variables_and_offline_flags() -> None:
    environ = {"AWS_SECRET_ACCESS_KEY": "s3cret", "HF_HUB_OFFLINE": "1", "OTHER": "x"}
    env = resolve_runtime_env({"env_vars_from": ["AWS_SECRET_ACCESS_KEY"], "env_vars": {"A": 1}, "pip": ["x"]}, environ)
    # the secret reaches the workers through a setup hook, never through env_vars (Ray logs those)
    hook = WorkerEnv({"AWS_SECRET_ACCESS_KEY": "s3cret"})
    assert env == {"env_vars": {"HF_HUB_OFFLINE": "1", "A": "1"}, "pip": ["x"], "worker_process_setup_hook": hook}
    assert "s3cret" not in repr(env)
    assert resolve_runtime_env({}, {}) == {}
    with pytest.raises(ValueError, match=r"names \['AWS_ACCESS_KEY_ID'\], which this process's environment does not"):
        resolve_runtime_env({"env_vars_from": ["AWS_ACCESS_KEY_ID"]}, environ)
    with pytest.raises(ValueError, match="both in env_vars and in env_vars_from"):
        resolve_runtime_env({"env_vars_from": ["OTHER"], "env_vars": {"OTHER": "y"}}, environ)
    with pytest.raises(ValueError, match="must be a list of environment variable names"):
        resolve_runtime_env({"env_vars_from": "OTHER"}, environ)


def test_a_cluster_without_token_auth_is_refused_before_connecting() -> None:
    for address in ("auto", "10.0.0.5:6379", "ray://head.example:10001"):
        with pytest.raises(ValueError, match=r"RAY_AUTH_MODE is None, not 'token'.*export RAY_AUTH_MODE=token"):
            check_cluster_auth(address, {})
        check_cluster_auth(address, {"RAY_AUTH_MODE": "token"})  # allowed
    with pytest.raises(ValueError, match="RAY_AUTH_MODE is 'disabled'"):
        check_cluster_auth("10.0.0.5:6379", {"RAY_AUTH_MODE": "disabled"})
    for address in ("local", "127.0.0.1:6379", "localhost:6379", "[::1]:6379", "ray://127.0.0.1:10001"):
        check_cluster_auth(address, {})  # loopback only: reachable from this machine alone
        assert address == "local" or is_loopback_address(address)
    assert namespace_for("local", "r1") == "rlake" and namespace_for("10.0.0.5:6379", "r1") == "rlake:r1"


# ---- the script side: real Ray in a fresh process ----


def _probe_class():
    import torch

    from stages.workers.group import Worker

    class Probe(Worker):
        """What a rank sees: torch threads, its thread env vars, the forwarded variables, its node."""

        def seen(self) -> dict:
            import ray

            return {
                "torch_threads": torch.get_num_threads(),
                "omp": os.environ.get("OMP_NUM_THREADS"),
                "secret": os.environ.get(SECRET),
                "hf_offline": os.environ.get("HF_HUB_OFFLINE"),
                "node_id": ray.get_runtime_context().get_node_id(),
            }

        def all_reduce(self) -> float:
            import torch.distributed as dist

            t = torch.tensor([float(self.rank + 1)])
            dist.all_reduce(t)
            return float(t.item())

    return Probe


def _role_report(role: str, group, probe) -> dict:
    import ray

    from stages.workers.group import Worker

    pg = ray.util.get_placement_group(role_group_name("r1", role))
    table = ray.util.placement_group_table(pg)
    return {
        "names": sorted(n for n in ray.util.list_named_actors() if n.startswith(f"rlake:r1:{role}:")),
        "pg": {
            "id": pg.id.hex(),
            "strategy": table["strategy"],
            "bundles": [table["bundles"][i] for i in sorted(table["bundles"])],
            "bundle_nodes": [table["bundles_to_node_id"][i] for i in sorted(table["bundles_to_node_id"])],
        },
        "placements": group.call(Worker.placement),
        "seen": group.call(probe.seen),
    }


def _task_env() -> dict:
    import ray

    @ray.remote(num_cpus=0)
    def env() -> dict:
        return {"secret": os.environ.get(SECRET), "hf_offline": os.environ.get("HF_HUB_OFFLINE")}

    return ray.get(env.remote())


def _logs_with(ray, value: str) -> list[str]:
    """Files under this Ray session's directory (its logs, runtime_env_agent.log included) holding `value`."""
    session = Path(ray._private.worker._global_node.get_session_dir_path())
    return sorted(str(p) for p in session.rglob("*") if p.is_file() and value.encode() in p.read_bytes())


def main_local(report_path: str) -> None:
    import ray

    from stages.workers.connect import RaySettings, configure
    from stages.workers.group import ensure_ray, gc_run, worker_group

    probe = _probe_class()
    runtime_env = {"env_vars_from": [SECRET]}
    ensure_ray(
        "local",
        5,
        run_id="r1",
        runtime_env=runtime_env,
        resources_per_worker={"actor": {"CPU": 2}, "rollout": {"CPU": 1}},
    )
    actor = worker_group(probe, "actor", 2, threads=1, process_group=True)
    rollout = worker_group(probe, "rollout", 1, threads=1)
    report = {
        "actor": _role_report("actor", actor, probe),
        "rollout": _role_report("rollout", rollout, probe),
        "all_reduce": actor.call(probe.all_reduce),
        "task": _task_env(),
        "namespace": ray.get_runtime_context().namespace,
        "logs_with_secret": _logs_with(ray, "forwarded-42"),
    }
    # the run's resources change (another process of the run with another config): the group is rebuilt
    configure(RaySettings(run_id="r1", local=True, resources_per_worker={"actor": {"CPU": 1}}))
    again = worker_group(probe, "actor", 2, threads=1, process_group=True)
    report["actor_again"] = _role_report("actor", again, probe)
    report["old_pg_state"] = ray.util.placement_group_table()[report["actor"]["pg"]["id"]]["state"]
    report["gc"] = gc_run("r1")
    report["named_after_gc"] = ray.util.list_named_actors()
    report["pg_states_after_gc"] = sorted(
        (i["name"], i["state"]) for i in ray.util.placement_group_table().values() if i["name"]
    )
    Path(report_path).write_text(json.dumps(report, indent=1, default=str))
    ray.shutdown()


def main_nodes(report_path: str) -> None:
    import ray
    from ray.cluster_utils import Cluster

    from stages.workers.group import _at_exit, ensure_ray, gc_run, worker_group

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node_a": 2}, "include_dashboard": False}
    )
    node_b = cluster.add_node(num_cpus=2, resources={"node_b": 2})
    cluster.wait_for_nodes()
    try:
        probe = _probe_class()
        ensure_ray(
            cluster.address,
            run_id="r1",
            resources_per_worker={"actor": {"CPU": 1, "node_b": 1}, "rollout": {"CPU": 1, "node_a": 1}},
        )
        actor = worker_group(probe, "actor", 2, threads=1, process_group=True)
        rollout = worker_group(probe, "rollout", 1, threads=1)
        report = {
            "address": cluster.address,
            "node_b": node_b.node_id,
            "head": cluster.head_node.node_id,
            "namespace": ray.get_runtime_context().namespace,
            "actor": _role_report("actor", actor, probe),
            "rollout": _role_report("rollout", rollout, probe),
            "all_reduce": actor.call(probe.all_reduce),
        }
        _at_exit()  # what the driver's exit does on a cluster: the run's workers stay for its next process
        report["named_after_exit_hook"] = sorted(ray.util.list_named_actors())
        report["gc"] = gc_run("r1")
        report["named_after_gc"] = ray.util.list_named_actors()
        Path(report_path).write_text(json.dumps(report, indent=1, default=str))
        ray.shutdown()
    finally:
        cluster.shutdown()


def _run(mode: str, tmp_path: Path) -> dict:
    report_path = tmp_path / f"{mode}.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({"PYTHONPATH": str(ROOT), SECRET: "forwarded-42", "HF_HUB_OFFLINE": "1"})
    if mode == "nodes":  # the test cluster's nodes on 127.0.0.1 (Ray would take the NIC address)
        env.update({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "GLOO_SOCKET_IFNAME": "lo"})
    proc = subprocess.run(
        [sys.executable, __file__, mode, str(report_path)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return json.loads(report_path.read_text())


def _assert_rank_i_in_bundle_i(role: dict, n: int) -> None:
    assert [(p["placement_group"], p["bundle_index"]) for p in role["placements"]] == [
        (role["pg"]["id"], i) for i in range(n)
    ]


@pytest.mark.ray
def test_roles_get_pack_placement_groups_threads_env_and_gc(tmp_path: Path) -> None:
    r = _run("local", tmp_path)
    assert r["namespace"] == "rlake"
    actor, rollout = r["actor"], r["rollout"]
    assert actor["pg"]["strategy"] == rollout["pg"]["strategy"] == "PACK"
    assert actor["pg"]["bundles"] == [{"CPU": 2.0}, {"CPU": 2.0}] and rollout["pg"]["bundles"] == [{"CPU": 1.0}]
    _assert_rank_i_in_bundle_i(actor, 2)
    _assert_rank_i_in_bundle_i(rollout, 1)
    assert [p["resources"] for p in actor["placements"]] == [{"CPU": 2.0}] * 2  # each rank holds its whole bundle
    assert [s["torch_threads"] for s in actor["seen"]] == [2, 2] and [s["omp"] for s in actor["seen"]] == ["2", "2"]
    assert [s["torch_threads"] for s in rollout["seen"]] == [1]
    assert actor["names"][0].startswith("rlake:r1:actor:") and len(actor["names"]) == 2
    assert r["all_reduce"] == [3.0, 3.0]  # 1 + 2 over the actor ranks' gloo group
    # env_vars_from and HF_HUB_OFFLINE reach every actor and task
    for seen in (*actor["seen"], *rollout["seen"], r["task"]):
        assert (seen["secret"], seen["hf_offline"]) == ("forwarded-42", "1")
    assert r["logs_with_secret"] == []  # ... and no Ray log or record of the session holds its value
    # new resources for the role: a new placement group, new bundles and threads; the old group is gone
    again = r["actor_again"]
    assert again["pg"]["id"] != actor["pg"]["id"] and again["pg"]["bundles"] == [{"CPU": 1.0}] * 2
    assert [s["torch_threads"] for s in again["seen"]] == [1, 1]
    assert r["old_pg_state"] == "REMOVED"
    _assert_rank_i_in_bundle_i(again, 2)
    # gc: the actor group (2 ranks) and the rollout group (1), and both placement groups
    assert sorted(r["gc"]["actors"]) == sorted(again["names"] + rollout["names"])
    assert sorted(r["gc"]["placement_groups"]) == ["rlake:r1:actor", "rlake:r1:rollout"]
    assert r["named_after_gc"] == []
    assert all(state == "REMOVED" for _, state in r["pg_states_after_gc"]), r["pg_states_after_gc"]


@pytest.mark.ray
@pytest.mark.slow
def test_roles_land_on_the_nodes_their_bundles_name(tmp_path: Path) -> None:
    r = _run("nodes", tmp_path)
    assert r["address"].startswith("127.0.0.1:") and r["namespace"] == "rlake:r1"
    actor, rollout = r["actor"], r["rollout"]
    assert actor["pg"]["bundle_nodes"] == [r["node_b"]] * 2 and rollout["pg"]["bundle_nodes"] == [r["head"]]
    assert [s["node_id"] for s in actor["seen"]] == [r["node_b"]] * 2
    assert [s["node_id"] for s in rollout["seen"]] == [r["head"]]
    _assert_rank_i_in_bundle_i(actor, 2)
    assert r["all_reduce"] == [3.0, 3.0]  # a TCPStore rendezvous on the cluster
    assert len(r["named_after_exit_hook"]) == 3  # kept for the run's next process
    assert sorted(r["gc"]["placement_groups"]) == ["rlake:r1:actor", "rlake:r1:rollout"]
    assert r["named_after_gc"] == []


def test_rlake_gc_refuses_a_local_address(capsys) -> None:
    assert main_cli(["gc", "--run-id", "r1"]) == 2
    assert "ray.address is 'local': a local cluster is the training process's own" in capsys.readouterr().err


def test_rlake_gc_refuses_a_cluster_without_token_auth(capsys, monkeypatch) -> None:
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    assert main_cli(["gc", "--run-id", "r1", "ray.address=10.255.0.1:6379"]) == 2
    assert "RAY_AUTH_MODE is None, not 'token'" in capsys.readouterr().err


if __name__ == "__main__":
    {"local": main_local, "nodes": main_nodes}[sys.argv[1]](sys.argv[2])
