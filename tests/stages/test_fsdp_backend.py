"""FSDP2 backend (actor.strategy='fsdp', stages/train/fsdp.py) against torch DDP, on CPU over gloo.

One PPO iteration (2 optimizer steps x 2 micro-batches of 2 rollouts, AdamW lr 1e-3, grad clip 1.0, entropy
bonus) of a tiny tied Qwen2 (4 layers) from one advantages Delta table, through the real
`ActorWorker.update(request)` in 2 spawned gloo processes per backend; then a second iteration of each from
its own checkpoint, so the FSDP optimizer state goes through the torch backend's checkpoint format and back.
Compared: the HF checkpoint, update_metrics.json, the optimizer state (HF parameter order).

Tolerances (measured max differences in brackets): FSDP all-gathers the same float32 weights, reduce-scatters
(averages) the same gradients as DDP's all-reduce (a sum of 2 values and a halving: exact) and runs elementwise
AdamW on the shards; only the grad norm is summed in another order (per shard, then over ranks), so the clip
coefficient can differ in its last bits, and AdamW amplifies that for weights with near-zero gradients. Weights
atol 3e-6 per element [first iteration 0 (bit-equal), second 3.0e-7], metrics rel 1e-5 [0], AdamW moments
atol 1e-7 / rtol 1e-5 [0, 3.0e-9].
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from tests.stages.helpers_backend_update import load_out, policy_and_advantages, spawn_update, update_request

W_ATOL = 3e-6
METRIC_REL = 1e-5


@pytest.fixture(scope="module")
def policy_and_table(tmp_path_factory) -> dict:
    return policy_and_advantages(tmp_path_factory.mktemp("fsdp"), tie_word_embeddings=True)


def make_job(ctx: dict, out: str, strategy: str, policy_dir: Path | None = None):
    actor = {
        "strategy": strategy,
        "num_workers": 2,
        "ppo_mini_batch_size": 1,
        "ppo_micro_batch_size": 2,
        "entropy_coeff": 0.01,
        "optim": {"lr": 1e-3, "grad_clip": 1.0},
    }
    return update_request(ctx, out, actor, policy_dir)


def assert_same_outputs(a: str, b: str, w0: dict[str, torch.Tensor]) -> None:
    wa, oa, ma = load_out(a)
    wb, ob, mb = load_out(b)
    assert sorted(wa) == sorted(wb) == sorted(w0)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=W_ATOL, rtol=0, msg=lambda m, k=k: f"{k}: {m}")
        assert not torch.equal(wb[k], w0[k]), f"{k} did not change in the update"
    skip = ("timing_s/", "actor/weights_loaded_from_disk")  # provenance, not results
    keys = {k for k in ma if not k.startswith(skip)}
    assert keys == {k for k in mb if not k.startswith(skip)}
    for k in sorted(keys):
        assert ma[k] == pytest.approx(mb[k], rel=METRIC_REL, abs=1e-7), k
    sa, sb = oa["optimizer"], ob["optimizer"]
    assert sorted(sa["state"]) == sorted(sb["state"]) == list(range(len(wa)))  # one per (untied) parameter
    for i in sa["state"]:
        for m in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sa["state"][i][m], sb["state"][i][m], atol=1e-7, rtol=1e-5)
    assert [g["params"] for g in sa["param_groups"]] == [g["params"] for g in sb["param_groups"]]
    assert oa["scheduler"] == ob["scheduler"]


@pytest.fixture(scope="module")
def outs(policy_and_table) -> dict[str, str]:
    """Two iterations per backend, each from the same backend's previous checkpoint."""
    out = {}
    for strategy in ("torch", "fsdp"):
        first = spawn_update(make_job(policy_and_table, f"{strategy}_it0", strategy), 2)
        out[strategy] = first
        out[f"{strategy}_it1"] = spawn_update(make_job(policy_and_table, f"{strategy}_it1", strategy, Path(first)), 2)
    return out


@pytest.fixture(scope="module")
def initial_weights(policy_and_table) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(policy_and_table["root"] / "policy" / "model.safetensors"))


def test_fsdp_matches_torch_ddp(outs, initial_weights) -> None:
    assert_same_outputs(outs["fsdp"], outs["torch"], initial_weights)


def test_fsdp_resumes_from_its_checkpoint_like_ddp(outs) -> None:
    """The second iteration loads the first's weights and optimizer state (torch format) onto the shards."""
    w1, _, _ = load_out(outs["torch"])
    assert_same_outputs(outs["fsdp_it1"], outs["torch_it1"], w1)
    _, opt, _ = load_out(outs["fsdp_it1"])
    assert opt["scheduler"]["last_epoch"] == 4  # 2 optimizer steps per iteration, resumed
