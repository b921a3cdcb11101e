"""GPU placement on a CPU machine (stages/workers/placement.py): what each role's ranks request from the run
config, the device a worker resolves, the Megatron CPU-patch gate, and one real Ray cluster declaring 2 fake
GPUs (in its own process) on which every role's ranks get a share of GPU i of one STRICT_PACK placement
group in rank order, train over gloo, and write the same weights as a CPU run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from configs.schema import load_config
from stages.policy_checkpoint import update_request
from stages.train.megatron.cpu_patches import apply_cpu_patches, needs_cpu_patches
from stages.workers.placement import (
    CPU_ONLY,
    GPU_ROLES,
    GPU_SHARE,
    GpuPool,
    RankPlacement,
    actor_options,
    collective_backend,
    rank_placements,
    resolve_device,
    worker_device,
)
from stages.workers.rollout_worker import RolloutWorker

HELPER = Path(__file__).with_name("helpers_fake_gpus.py")


def test_the_default_config_is_a_cpu_run_requesting_no_gpu() -> None:
    cfg = load_config(None)
    assert GpuPool.of(cfg.trainer) == CPU_ONLY and CPU_ONLY.size == 0
    for role in GPU_ROLES:
        placements = rank_placements(GpuPool.of(cfg.trainer), role, 2)
        assert placements == [RankPlacement(), RankPlacement()]
        assert [actor_options(p) for p in placements] == [{}, {}]  # the actors are created as before


def test_every_role_gets_a_share_of_gpu_i_on_node_i_div_n() -> None:
    cfg = load_config(None, ["trainer.n_gpus_per_node=2", "trainer.nnodes=2", "actor.num_workers=4"])
    pool = GpuPool.of(cfg.trainer)
    assert (pool.n_gpus_per_node, pool.nnodes, pool.size) == (2, 2, 4)
    counts = {"actor": cfg.actor.num_workers, "rollout": 4, "ref": 3, "teacher": 2, "critic": 1, "reward_model": 2}
    counts["judge"] = 4
    per_gpu: dict[tuple[int, int], float] = {}
    for role, n in counts.items():
        placements = rank_placements(pool, role, n)
        # rank i -> node i // 2, bundle i % 2: the trainer's rank order is the bundle order
        assert [(p.node, p.bundle_index) for p in placements] == [(i // 2, i % 2) for i in range(n)]
        assert [p.placement_group for p in placements] == [f"rlake-gpus:2x2:{i // 2}" for i in range(n)]
        for p in placements:
            assert p.num_gpus == pytest.approx(1 / len(GPU_ROLES))
            per_gpu[(p.node, p.bundle_index)] = per_gpu.get((p.node, p.bundle_index), 0.0) + p.num_gpus
    # a rank of every role fits on one GPU (colocation), never more than one GPU's worth
    assert max(per_gpu.values()) == pytest.approx(len(GPU_ROLES) * GPU_SHARE) == pytest.approx(1.0)


def test_the_update_request_carries_the_configs_gpu_pool(tmp_path: Path) -> None:
    cfg = load_config(None, ["trainer.n_gpus_per_node=2"])
    req = update_request(cfg, 0, advantages_uri="a", advantages_version=0, policy_dir=tmp_path, out_dir=tmp_path)
    assert req.gpus == GpuPool(2, 1)
    cpu = update_request(
        load_config(None), 0, advantages_uri="a", advantages_version=0, policy_dir=tmp_path, out_dir=tmp_path
    )
    assert cpu.gpus == CPU_ONLY


def test_a_role_with_more_ranks_than_gpus_is_refused() -> None:
    with pytest.raises(ValueError, match=r"'rollout' group has 3 workers but the GPU pool has 2 GPUs"):
        rank_placements(GpuPool(2, 1), "rollout", 3)
    with pytest.raises(ValidationError, match=r"\{'actor.num_workers': 2\} exceed the GPU pool of 1 GPUs"):
        load_config(None, ["trainer.n_gpus_per_node=1"])  # tiny_cpu's default has 2 trainer ranks
    with pytest.raises(ValidationError, match=r"trainer.n_gpus_per_node \(-1\) must be >= 0"):
        load_config(None, ["trainer.n_gpus_per_node=-1"])
    with pytest.raises(ValidationError, match=r"rollout.gpu_memory_utilization \(1.0\) must lie in \(0, 1\)"):
        load_config(None, ["trainer.n_gpus_per_node=2", "rollout.gpu_memory_utilization=1.0"])


@pytest.mark.parametrize(
    "gpu_ids, cuda, device",
    [
        ([], False, "cpu"),  # a CPU run
        (["0"], False, "cpu"),  # fake GPUs (this test machine): Ray assigned one, there is no CUDA
        ([], True, "cpu"),  # a GPU machine, but this role asked for no GPU
        (["3"], True, "cuda:0"),  # Ray's CUDA_VISIBLE_DEVICES=3 makes the assigned GPU device 0
    ],
)
def test_the_device_is_cuda0_only_with_an_assigned_gpu_and_cuda(gpu_ids: list, cuda: bool, device: str) -> None:
    resolved = resolve_device(gpu_ids, cuda)
    assert resolved == torch.device(device)
    assert collective_backend(resolved) == ("nccl" if device.startswith("cuda") else "gloo")


def test_outside_a_ray_actor_the_device_is_this_machines_default() -> None:
    assert worker_device() == torch.device("cpu")  # the driver and use_ray=False workers get no GPU


def test_megatron_cpu_patches_apply_on_the_cpu_only() -> None:
    assert needs_cpu_patches("cpu") and needs_cpu_patches(torch.device("cpu"))
    assert not needs_cpu_patches("cuda:0") and not needs_cpu_patches(torch.device("cuda", 0))
    assert needs_cpu_patches(None) == (not torch.cuda.is_available())
    assert apply_cpu_patches(device="cuda:0") == []  # a GPU rank: megatron-core runs as released


def test_engines_get_gpu_settings_only_on_a_cuda_device() -> None:
    hf = RolloutWorker(0, 1, 1, engine="hf", micro_batch_size=8)
    vllm = RolloutWorker(0, 1, 1, engine="vllm", micro_batch_size=8, gpu_memory_utilization=0.3)
    # on the CPU both engines are built exactly as before GPU placement existed
    assert hf.engine_kwargs() == {"micro_batch_size": 8, "num_threads": 1}
    assert vllm.engine_kwargs() == {"micro_batch_size": 8, "num_threads": None}
    hf.device = vllm.device = torch.device("cuda", 0)  # what a worker Ray gave a GPU resolves to with CUDA
    assert hf.engine_kwargs() == {"micro_batch_size": 8, "num_threads": 1, "device": "cuda:0"}
    assert vllm.engine_kwargs() == {
        "micro_batch_size": 8,
        "num_threads": None,
        "gpu_memory_utilization": 0.3,
        "enable_sleep_mode": True,
    }


@pytest.mark.ray
@pytest.mark.slow
def test_fake_gpus_place_every_role_in_rank_order_and_train_as_on_cpu(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, str(HELPER), str(report_path), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(report_path.read_text())
    assert report["cluster_gpus"] == 2.0
    pg = report["placement_group"]
    assert pg["strategy"] == "STRICT_PACK" and pg["bundles"] == [{"GPU": 1.0}, {"GPU": 1.0}] and len(pg["nodes"]) == 1
    expected_ranks = {"actor": 2, "rollout": 2, "ref": 2, "critic": 1, "judge": 2}
    gpu_of_bundle: dict[int, list[str]] = {}
    for role, ranks in report["placements"].items():
        assert len(ranks) == expected_ranks[role], role
        for rank, got in enumerate(ranks):
            assert got["placement_group"] == pg["id"] and got["bundle_index"] == rank, (role, rank, got)
            assert got["resources"]["GPU"] == pytest.approx(GPU_SHARE, abs=1e-3), (role, got)
            assert got["device"] == "cpu"  # no CUDA here: the fake GPU changes nothing inside the worker
            assert got["cuda_visible_devices"] == ",".join(got["gpu_ids"])  # what Ray sets on a real GPU
            gpu_of_bundle.setdefault(rank, []).append(got["gpu_ids"][0])
    # colocation: rank i of every role sits on the same GPU, and rank 0 and rank 1 on different ones
    assert all(len(set(ids)) == 1 for ids in gpu_of_bundle.values()) and gpu_of_bundle[0][0] != gpu_of_bundle[1][0]
    assert [r["process_group"] for r in report["placements"]["actor"]] == ["gloo", "gloo"]  # no CUDA: gloo
    # the update found the group and resident policy the old_logprobs stage built: both used the run's pool
    assert report["gpu_metrics"]["actor/weights_loaded_from_disk"] == 0.0
    assert report["weights_changed"] and report["weights_equal"]  # fake-GPU update == CPU update, bitwise
    assert report["gpu_metrics"]["actor/pg_loss"] == report["cpu_metrics"]["actor/pg_loss"]
    assert report["placement_group_after_shutdown"] == "REMOVED"
    again = report["placements_after_shutdown"]
    assert report["placement_group_recreated"] != pg["id"]
    assert [(p["placement_group"], p["bundle_index"]) for p in again] == [
        (report["placement_group_recreated"], i) for i in (0, 1)
    ]
    assert "asks for 4 GPUs" in report["too_many_gpus_error"] and "has 2" in report["too_many_gpus_error"]
