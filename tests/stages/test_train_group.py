"""actor.worker_backend='ray_train': the trainer ranks are one Ray Train run kept for the whole rlake run
(stages/workers/train_group.py). On a real local Ray: the update equals the WorkerGroup's bit for bit and the
policy stays resident between iterations; a rank killed during an update is restarted by Ray Train itself (same
host, same fit) and the update is retried on the restarted ranks; the GPU pool is refused."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
import ray
import torch

from configs.schema import ActorConfig, load_config
from stages.policy_checkpoint import actor_group, run_update
from stages.workers.actor_worker import ActorWorker
from stages.workers.group import shutdown_worker_groups
from stages.workers.train_group import TrainGroup

sys.path.insert(0, str(Path(__file__).parent))
from test_worker_group import _request, _weights

pytestmark = pytest.mark.ray
CI = Path(__file__).parents[2] / "configs" / "ci_tiny.yaml"


def _ray_train(req):
    return req.__class__(**{**req.__dict__, "actor": req.actor.model_copy(update={"worker_backend": "ray_train"})})


def test_ray_train_update_equals_worker_group_and_keeps_the_policy_resident(
    ray_session, tiny_checkpoint, tmp_path
) -> None:
    shutdown_worker_groups()
    run_update(_request(tmp_path, tiny_checkpoint, "wg1", 0))
    wg = run_update(_request(tmp_path, tmp_path / "wg1", "wg2", 1))
    shutdown_worker_groups()

    first = run_update(_ray_train(_request(tmp_path, tiny_checkpoint, "rt1", 0)))
    group = actor_group(_ray_train(_request(tmp_path, tmp_path / "rt1", "rt2", 1)))
    assert isinstance(group, TrainGroup)
    host_pid = ray.get(group.handles[0].pid.remote())
    rt = run_update(_ray_train(_request(tmp_path, tmp_path / "rt1", "rt2", 1)))
    state = ray.get(group.handles[0].state.remote())
    assert first["actor/weights_loaded_from_disk"] == 1.0
    assert rt["actor/weights_loaded_from_disk"] == 0.0  # the Ray Train ranks kept v1 and its optimizer
    assert state["attempt"] == 0 and len(set(state["pids"].values()) - {os.getpid(), host_pid}) == 2
    for key in ("actor/pg_loss", "actor/ppo_kl", "actor/grad_norm"):
        assert rt[key] == wg[key], key
    worst = max((a - b).abs().max().item() for a, b in zip(_weights(tmp_path / "wg2"), _weights(tmp_path / "rt2")))
    assert worst == 0.0, f"Ray Train vs WorkerGroup update differ by {worst:.2e}"

    megatron = ActorConfig(strategy="megatron")  # a Python error in the ranks reaches the caller as itself
    with pytest.raises(ValueError, match="reached a 'torch' ActorWorker") as raised:
        group.call(ActorWorker.compute_log_prob, str(tmp_path / "rt2"), pd.DataFrame(), megatron, 1.0)
    assert re.match(r"rank [01] of the Ray Train group raised in compute_log_prob", raised.value.__notes__[0])
    assert group.handles == []  # stopped, as a WorkerGroup is killed: a peer may wait in a collective
    shutdown_worker_groups()


def test_rank_killed_during_an_update_is_restarted_by_ray_train(ray_session, tiny_checkpoint, tmp_path) -> None:
    shutdown_worker_groups()
    run_update(_ray_train(_request(tmp_path, tiny_checkpoint, "v1", 0)))
    req = _ray_train(_request(tmp_path, tmp_path / "v1", "v2", 1))
    host = actor_group(req).handles[0]
    before = ray.get(host.state.remote())
    out: dict = {}
    worker = threading.Thread(target=lambda: out.update(run_update(req)))
    worker.start()
    while ray.get(host.state.remote())["seq"] == before["seq"]:
        time.sleep(0.01)
    os.kill(before["pids"][1], signal.SIGKILL)  # the update's command is out: the rank dies in (or before) it
    worker.join(timeout=240)

    after = ray.get(host.state.remote())
    assert not worker.is_alive() and out["actor/num_rollouts"] == 16.0
    assert after["attempt"] == 1 and after["ended"] is None  # restarted once by Ray Train, the same fit
    assert after["pids"][1] != before["pids"][1] and ray.get(host.pid.remote()) == ray.get(host.pid.remote())
    assert (tmp_path / "v2" / "config.json").is_file() and not (tmp_path / "v2.tmp").exists()
    assert torch.isfinite(torch.stack([w.float().abs().max() for w in _weights(tmp_path / "v2")])).all()
    shutdown_worker_groups()


def test_ray_train_backend_refuses_the_gpu_pool() -> None:
    with pytest.raises(ValueError, match="Ray Train's ScalingConfig cannot place ranks in an existing placement"):
        load_config(CI, ["actor.worker_backend=ray_train", "trainer.n_gpus_per_node=1"])
    cfg = load_config(CI, ["actor.worker_backend=ray_train", "actor.ray_train_max_failures=1"])
    assert cfg.actor.worker_backend == "ray_train" and cfg.actor.ray_train_max_failures == 1
