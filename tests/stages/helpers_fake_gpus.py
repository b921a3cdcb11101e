"""Run in its own process by tests/stages/test_placement.py: a fresh local Ray on 127.0.0.1 that declares 2
fake GPUs (`ray.init(num_gpus=2)` on a machine without CUDA), the run's worker groups on a GPU pool of 2, and
what each rank was given. Writes a JSON report to argv[1]; argv[2] is a scratch directory.

A separate process because the test session shares one Ray cluster without GPUs, and a Ray driver cannot
re-initialise with other resources."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).parent)]

import pandas as pd  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
from helpers_rollouts import make_rows  # noqa: E402

from configs.schema import TinyModelConfig, load_config  # noqa: E402
from stages.io import store  # noqa: E402
from stages.judgements import judge_group  # noqa: E402
from stages.models.policy import load_policy, save_policy  # noqa: E402
from stages.models.tiny import build_char_tokenizer, build_tiny_model  # noqa: E402
from stages.old_logprobs import policy_old_logprobs  # noqa: E402
from stages.policy_checkpoint import actor_workers, run_update, update_request  # noqa: E402
from stages.ref_logprobs import reference_logprobs  # noqa: E402
from stages.rollouts import rollout_group  # noqa: E402
from stages.train.critic import init_critic  # noqa: E402
from stages.values import rollout_values  # noqa: E402
from stages.workers.group import Worker, WorkerGroup, _find, shutdown_worker_groups  # noqa: E402
from stages.workers.placement import GpuPool, node_placement_group  # noqa: E402

OVERRIDES = [
    "actor.num_workers=2",
    "rollout.num_workers=2",
    "rollout.name=hf",
    "rollout.n=4",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=4",
    "actor.ppo_micro_batch_size=4",
    "reward.judge.num_workers=2",
]
GPU_CFG = load_config(None, [*OVERRIDES, "trainer.n_gpus_per_node=2"])
CPU_CFG = load_config(None, OVERRIDES)


def _rollouts() -> pd.DataFrame:
    df = make_rows(16)
    lengths = df["response_token_ids"].map(len)
    return df.assign(response_length=lengths, rollout_logprobs=[[-1.0] * n for n in lengths])


def _placements(role: str, worker_cls: type = Worker) -> list[dict]:
    return WorkerGroup(worker_cls, role, _find(role)).call(Worker.placement)


def main(report_path: str, scratch_dir: str) -> None:
    scratch = Path(scratch_dir)
    tok = build_char_tokenizer()
    policy = scratch / "policy_v0"
    save_policy(build_tiny_model(TinyModelConfig(hidden_size=64, intermediate_size=128), len(tok), seed=0), tok, policy)
    rollouts = _rollouts()
    uri = str(scratch / "advantages")
    version = store.write_partition(
        uri, "advantages", rollouts, run_id=GPU_CFG.run_id, iteration=0, lineage={"stage": "test"}
    )
    ray.init(
        address="local",
        num_cpus=2,
        num_gpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        namespace="rlake",
        _node_ip_address="127.0.0.1",
    )
    report: dict = {"cluster_gpus": ray.cluster_resources().get("GPU", 0)}
    pool = GpuPool.of(GPU_CFG.trainer)
    # each stage builds its role's group from the run config, as the assets do
    policy_old_logprobs(GPU_CFG, rollouts, policy)
    reference_logprobs(GPU_CFG, rollouts, policy)
    rollout_values(GPU_CFG, rollouts, init_critic(policy, scratch / "critic_v0"), 0)
    rollout_group(GPU_CFG.rollout, pool)
    judge_group(GPU_CFG.reward.judge, "hf", pool)
    report["placements"] = {role: _placements(role) for role in ("actor", "rollout", "ref", "critic", "judge")}
    pg = node_placement_group(pool, 0)
    table = ray.util.placement_group_table(pg)
    report["placement_group"] = {
        "id": pg.id.hex(),
        "strategy": table["strategy"],
        "bundles": [table["bundles"][i] for i in sorted(table["bundles"])],
        "nodes": sorted(set(table["bundles_to_node_id"].values())),
    }

    def update(cfg, out: str) -> dict:
        return run_update(
            update_request(
                cfg, 0, advantages_uri=uri, advantages_version=version, policy_dir=policy, out_dir=scratch / out
            )
        )

    report["gpu_metrics"] = update(GPU_CFG, "gpu_v1")  # the group old_logprobs built, its policy resident
    shutdown_worker_groups()
    report["placement_group_after_shutdown"] = ray.util.placement_group_table(pg)["state"]
    report["cpu_metrics"] = update(CPU_CFG, "cpu_v1")
    gpu_w, cpu_w = (load_policy(scratch / d)[0].state_dict() for d in ("gpu_v1", "cpu_v1"))
    report["weights_equal"] = all(torch.equal(gpu_w[k], cpu_w[k]) for k in gpu_w)
    report["weights_changed"] = any(
        not torch.equal(gpu_w[k], v) for k, v in load_policy(policy)[0].state_dict().items()
    )
    shutdown_worker_groups()
    # a removed pool's name is free again: the next GPU group makes a new placement group of that name
    report["placements_after_shutdown"] = rollout_group(GPU_CFG.rollout, pool).call(Worker.placement)
    report["placement_group_recreated"] = node_placement_group(pool, 0).id.hex()
    shutdown_worker_groups()
    try:
        actor_workers(GPU_CFG.actor, 1, GpuPool(n_gpus_per_node=4))
        report["too_many_gpus_error"] = None
    except RuntimeError as exc:
        report["too_many_gpus_error"] = str(exc)
    shutdown_worker_groups()
    Path(report_path).write_text(json.dumps(report, indent=1, default=str))
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
