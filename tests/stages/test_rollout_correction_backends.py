"""algorithm.rollout_correction through each backend's real `ActorWorker.update(request)` (CPU, gloo): the
engine's rollout_logprobs read from the advantages table, token TIS + batch normalization + token rejection,
with the same result from the torch backend at world 1, torch DDP at world 2 (the batch mean all-reduced)
and Megatron at PP = 2 (the correction computed from the last stage's old log-probs). Tolerances and the
tiny policy are tests/stages/test_megatron_backend.py's."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
pytest.importorskip("megatron.core")

from configs.schema import RolloutCorrectionConfig
from stages.io.store import read_partition, write_partition
from tests.stages.helpers_backend_update import load_out, policy_and_advantages, spawn_update
from tests.stages.test_megatron_backend import assert_same_outputs, make_job, update_in_process

pytestmark = [pytest.mark.megatron, pytest.mark.slow]
CORRECTION = RolloutCorrectionConfig(
    rollout_is="token", rollout_is_threshold=1.5, rollout_is_batch_normalize=True, rollout_rs="token_k1",
    rollout_rs_threshold="0.4_2.5",
)  # fmt: skip


@pytest.fixture(scope="module")
def ctx(tmp_path_factory) -> dict:
    """The tiny policy and its advantages table, the rows given engine log-probs near the policy's own
    (about -ln 80 for a random char-level model) with noise, so some weights are truncated and some rejected."""
    c = policy_and_advantages(tmp_path_factory.mktemp("rollout_corr"))
    df = read_partition(c["advantages_uri"], "r", 0, version=c["advantages_version"])
    gen = torch.Generator().manual_seed(1)
    df["rollout_logprobs"] = [
        (-4.4 + 0.5 * torch.randn(len(r), generator=gen)).tolist() for r in df["response_token_ids"]
    ]
    uri = str(c["root"] / "advantages_rc")
    version = write_partition(
        uri,
        "advantages",
        df.drop(columns=["run_id", "iteration"], errors="ignore"),
        run_id="r",
        iteration=0,
        lineage={},
    )
    return {**c, "advantages_uri": uri, "advantages_version": version}


def _job(ctx: dict, out: str, **kw):
    return replace(make_job(ctx, out, **kw), rollout_correction=CORRECTION)


def test_backends_agree_with_the_correction_on(ctx) -> None:
    from safetensors.torch import load_file

    w0 = load_file(str(ctx["root"] / "policy" / "model.safetensors"))
    ref = _job(ctx, "torch", strategy="torch")
    update_in_process(ref)
    _, _, m = load_out(ref.out_dir)
    assert 0.0 < m["rollout_corr/rollout_rs_masked_fraction"] < 1.0
    assert (
        m["rollout_corr/rollout_is_ratio_fraction_high"] > 0.0 and m["rollout_corr/rollout_is_batch_norm_factor"] != 1.0
    )
    off = make_job(ctx, "torch_off", strategy="torch")
    update_in_process(off)
    w_ref, w_off = load_out(ref.out_dir)[0], load_out(off.out_dir)[0]
    assert any(not torch.equal(w_ref[k], w_off[k]) for k in w_ref)  # the correction changed the update

    mega = _job(ctx, "megatron_pp2", pp=2, num_workers=2)
    spawn_update(mega, 2)
    assert_same_outputs(mega.out_dir, ref.out_dir, w0)  # every metric too, rollout_corr/ ones included

    # one mini-batch of every rollout (one step, so the ranks' mini-batch order cannot matter): DDP over 2 ranks
    # equals world 1; the batch mean is over both ranks' rows (all-reduced), per-rank statistics are averaged
    one = _job(ctx, "torch_one_step", strategy="torch", ppo_mini_batch_size=2)
    update_in_process(one)
    ddp = _job(ctx, "torch_ddp2", strategy="torch", ppo_mini_batch_size=2, num_workers=2)
    spawn_update(ddp, 2)
    (w_one, _, m_one), (w_ddp, _, m_ddp) = load_out(one.out_dir), load_out(ddp.out_dir)
    for k in w_one:
        torch.testing.assert_close(w_ddp[k], w_one[k], atol=3e-5, rtol=0)
    factor = "rollout_corr/rollout_is_batch_norm_factor"
    assert m_ddp[factor] == pytest.approx(m_one[factor], rel=1e-6) and m_one[factor] == m[factor]
