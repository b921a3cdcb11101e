"""Megatron backend (actor.strategy='megatron') against the torch backend, on CPU over gloo.

One PPO iteration (2 optimizer steps x 2 micro-batches of 2 rollouts, AdamW lr 1e-3, grad clip
1.0, entropy bonus) on a tiny tied Qwen2 (4 layers, 4 heads, 2 KV heads) from the same advantages
Delta table, through each backend's real `ActorWorker.update(request)`: torch in-process at world 1,
Megatron in spawned gloo processes at TP=1, TP=2, PP=2; and TP=2 x DP=2 against torch DDP at
world 2. Compared: the HF checkpoint, update_metrics.json, the optimizer state in HF order.

Tolerances (measured max differences in brackets): updated weights atol 3e-5 per element
[9.9e-6] and relative L2 of the weight update 1e-3 [2.3e-5]. The elementwise bound is loose
because AdamW turns a parameter with a near-zero gradient (e.g. the k_proj bias, whose exact
gradient is 0 by softmax shift invariance) into a sign-like step of up to lr, so float rounding
of such gradients shows up at ~1e-5; only ~12 of 129k weights differ by more than 1e-6.
Metrics (pg_loss, clipfrac, ppo_kl, entropy, grad_norm, lr) rel 1e-4 / abs 1e-6; AdamW moments
atol 1e-6 / rtol 1e-4.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
pytest.importorskip("megatron.core")

from tests.stages.helpers_backend_update import (
    N_PER_PROMPT,
    N_PROMPTS,
    load_out,
    policy_and_advantages,
    spawn_update,
    update_request,
)

pytestmark = pytest.mark.megatron
W_ATOL = 3e-5
UPDATE_RTOL = 1e-3


def update_in_process(req) -> None:
    """A world-1 update in this process (no process group: the torch backend runs without DDP)."""
    from stages.workers.actor_worker import ActorWorker

    ActorWorker(0, 1, 1, strategy=req.actor.strategy).update(req)


@pytest.fixture(scope="module")
def policy_and_table(tmp_path_factory) -> dict:
    return policy_and_advantages(tmp_path_factory.mktemp("megatron"))


def make_job(
    ctx: dict,
    out: str,
    *,
    strategy: str = "megatron",
    tp: int = 1,
    pp: int = 1,
    policy_dir: Path | None = None,
    **actor,
):
    actor_cfg = {
        "strategy": strategy,
        "ppo_mini_batch_size": 1,
        "ppo_micro_batch_size": 2,
        "ppo_epochs": 1,
        "entropy_coeff": 0.01,
        "optim": {"lr": 1e-3, "grad_clip": 1.0},
        "megatron": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp},
        **actor,
    }
    return update_request(ctx, out, actor_cfg, policy_dir)


def assert_same_outputs(a: str, b: str, w0: dict[str, torch.Tensor]) -> None:
    wa, oa, ma = load_out(a)
    wb, ob, mb = load_out(b)
    assert sorted(wa) == sorted(wb) == sorted(w0)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=W_ATOL, rtol=0, msg=lambda m, k=k: f"{k}: {m}")
        assert not torch.equal(wb[k], w0[k]), f"{k} did not change in the update"
    diff = torch.cat([(wa[k] - wb[k]).flatten() for k in wa]).norm()
    step = torch.cat([(wb[k] - w0[k]).flatten() for k in wa]).norm()
    assert diff / step < UPDATE_RTOL, f"relative update difference {float(diff / step):.2e}"
    skip = ("timing_s/", "actor/weights_loaded_from_disk")  # provenance, not results
    keys = {k for k in ma if not k.startswith(skip)}
    assert keys == {k for k in mb if not k.startswith(skip)}
    for k in sorted(keys):
        assert ma[k] == pytest.approx(mb[k], rel=1e-4, abs=1e-6), k
    sa, sb = oa["optimizer"], ob["optimizer"]
    assert sorted(sa["state"]) == sorted(sb["state"])
    for i in sa["state"]:
        for m in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sa["state"][i][m], sb["state"][i][m], atol=1e-6, rtol=1e-4)
    assert oa["scheduler"] == ob["scheduler"]


@pytest.fixture(scope="module")
def initial_weights(policy_and_table) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(policy_and_table["root"] / "policy" / "model.safetensors"))


@pytest.fixture(scope="module")
def torch_out(policy_and_table) -> str:
    job = make_job(policy_and_table, "torch", strategy="torch")
    update_in_process(job)
    return job.out_dir


@pytest.fixture(scope="module")
def megatron_outs(policy_and_table) -> dict[tuple[int, int], str]:
    outs = {}
    for tp, pp in [(1, 1), (2, 1), (1, 2)]:
        job = make_job(policy_and_table, f"megatron_tp{tp}_pp{pp}", tp=tp, pp=pp)
        spawn_update(job, tp * pp)
        outs[(tp, pp)] = job.out_dir
    return outs


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_megatron_matches_torch_backend(megatron_outs, torch_out, initial_weights, tp: int, pp: int) -> None:
    assert_same_outputs(megatron_outs[(tp, pp)], torch_out, initial_weights)
    _, _, metrics = load_out(megatron_outs[(tp, pp)])
    assert metrics["actor/num_rollouts"] == N_PROMPTS * N_PER_PROMPT
    assert {"timing_s/update_load", "timing_s/update_compute"} <= set(metrics)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_tp_pp_match_single_rank(megatron_outs, initial_weights, tp: int, pp: int) -> None:
    assert_same_outputs(megatron_outs[(tp, pp)], megatron_outs[(1, 1)], initial_weights)


@pytest.fixture(scope="module")
def torch_ddp2_out(policy_and_table) -> str:
    return spawn_update(make_job(policy_and_table, "torch_ddp2", strategy="torch", num_workers=2), 2)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_dp2_matches_torch_ddp(policy_and_table, torch_ddp2_out, initial_weights, tp: int) -> None:
    """DP = 2 replicas (of TP = tp ranks each): grads averaged over the DP group like DDP,
    rows split by DP rank like the torch workers."""
    job = make_job(policy_and_table, f"megatron_tp{tp}_dp2", tp=tp, num_workers=2 * tp)
    spawn_update(job, 2 * tp)
    assert_same_outputs(job.out_dir, torch_ddp2_out, initial_weights)


def test_resume_from_megatron_optimizer_state(policy_and_table, megatron_outs, torch_out) -> None:
    """A second iteration from a Megatron checkpoint (its optimizer.pt in HF order) matches the
    torch backend resuming from its own checkpoint: the state round-trips through the shards."""
    ref = make_job(policy_and_table, "torch_it1", strategy="torch", policy_dir=Path(torch_out))
    update_in_process(ref)
    job = make_job(policy_and_table, "megatron_it1", tp=2, policy_dir=Path(megatron_outs[(2, 1)]))
    spawn_update(job, 2)
    from safetensors.torch import load_file

    w1 = load_file(str(Path(torch_out) / "model.safetensors"))
    assert_same_outputs(job.out_dir, ref.out_dir, w1)
    assert torch.load(Path(job.out_dir) / "optimizer.pt", weights_only=False)["scheduler"]["last_epoch"] == 4


def test_num_workers_not_a_grid_is_rejected() -> None:
    from configs.schema import RunConfig

    with pytest.raises(ValueError, match="multiple of tensor_model_parallel_size"):
        RunConfig.model_validate(
            {
                "actor": {
                    "strategy": "megatron",
                    "num_workers": 2,
                    "megatron": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
                }
            }
        )


@pytest.mark.ray
@pytest.mark.slow
def test_worker_group_dispatch_tp2(ray_session, policy_and_table, megatron_outs, initial_weights, tmp_path) -> None:
    """stages.policy_checkpoint.run_update runs a strategy='megatron' request on the actor group (ActorWorkers of
    this backend, one gloo group) and returns rank 0's metrics."""
    from stages.policy_checkpoint import run_update

    job = make_job(policy_and_table, "megatron_ray_tp2", tp=2, num_workers=2)
    metrics = run_update(job)
    assert metrics["actor/num_rollouts"] == N_PROMPTS * N_PER_PROMPT
    assert_same_outputs(job.out_dir, megatron_outs[(2, 1)], initial_weights)


def test_rollout_temperature_reaches_both_backends(policy_and_table, torch_out, initial_weights) -> None:
    """verl divides the actor's logits by rollout.temperature (old and new log-probs, entropy): the
    request's temperature does that in both backends, identically."""
    torch_job = replace(make_job(policy_and_table, "torch_t07", strategy="torch"), temperature=0.7)
    update_in_process(torch_job)
    megatron_job = replace(make_job(policy_and_table, "megatron_t07"), temperature=0.7)
    spawn_update(megatron_job, 1)
    assert_same_outputs(megatron_job.out_dir, torch_job.out_dir, initial_weights)
    tempered, plain = load_out(torch_job.out_dir)[2], load_out(torch_out)[2]
    assert tempered["actor/entropy"] < plain["actor/entropy"]  # logits / 0.7: a sharper distribution
