"""actor.use_dynamic_bsz (stages/train/packing.py): micro-batches by a token budget, packed without padding,
give the padded path's loss and gradients (fp64 tiny Qwen2, 1e-6) under every loss_agg_mode, and its
log-probs; the token-budget split itself on hand-derived numbers."""

from __future__ import annotations

import pytest
import torch

from configs.schema import ActorConfig, TinyModelConfig
from stages.algos.losses import LOSS_AGG_MODES
from stages.models.tiny import build_tiny_model
from stages.train.actor import compute_logprobs, ppo_update
from stages.train.batching import pad_rollouts
from stages.train.packing import padding_share, token_budget_micro_batches

V = 40
PROMPT_LENS = [3, 7, 5, 1, 4, 6]
RESPONSE_LENS = [4, 0, 6, 2, 5, 1]  # row 1 has no response token: it counts in the seq-mean modes' row count


def test_token_budget_split_by_hand() -> None:
    # 14 tokens at budget 7 -> ceil(14/7) = 2 micro-batches; longest first into the lightest:
    # 5 (row 0) -> mb0 (5), 4 (row 2) -> mb1 (4), 3 (row 1) -> mb1 (7), 2 (row 3) -> mb0 (7): [[0, 3], [1, 2]]
    assert token_budget_micro_batches([5, 3, 4, 2], 7) == [[0, 3], [1, 2]]
    # budget 6 -> ceil(14/6) = 3: 5 (row 0) -> mb0, 4 (row 2) -> mb1, 3 (row 1) -> mb2, 2 (row 3) -> mb2 (5)
    assert token_budget_micro_batches([5, 3, 4, 2], 6) == [[0], [1, 3], [2]]
    assert token_budget_micro_batches([5, 3], 8, min_count=2) == [[0], [1]]
    with pytest.raises(ValueError, match="exceeds the token budget 4"):
        token_budget_micro_batches([5, 3], 4)


def rows(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, V, (n,), generator=g).tolist() for n in PROMPT_LENS]
    responses = [torch.randint(2, V, (n,), generator=g).tolist() for n in RESPONSE_LENS]
    return {
        "prompt_token_ids": prompts,
        "response_token_ids": responses,
        "advantages": torch.randn(len(prompts), generator=g),
        "ref_logprobs": [(-torch.rand(n, generator=g) * 3).tolist() for n in RESPONSE_LENS],
    }


def update_delta(mode: str, dynamic: bool) -> tuple[dict, list[torch.Tensor]]:
    """Metrics and parameter change of one SGD(lr=1) step over the whole batch: the (clipped) gradient."""
    model = build_tiny_model(TinyModelConfig(hidden_size=32, intermediate_size=64), V, seed=0).double()
    before = [p.detach().clone() for p in model.parameters()]
    cfg = ActorConfig(
        loss_agg_mode=mode,
        ppo_mini_batch_size=1,
        ppo_micro_batch_size=2,
        use_dynamic_bsz=dynamic,
        ppo_max_token_len_per_gpu=12,  # 44 tokens, longest 11: ceil(44/12) = 4 or more packed micro-batches
        log_prob_max_token_len_per_gpu=20,
        entropy_coeff=0.01,
        use_kl_loss=True,
    )
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    metrics = ppo_update(model, opt, sched, rows(), cfg, n_per_prompt=len(PROMPT_LENS), pad_id=0, temperature=0.7)
    return metrics, [p.detach() - b for p, b in zip(model.parameters(), before, strict=True)]


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_packed_update_equals_padded(mode: str) -> None:
    padded, d_padded = update_delta(mode, dynamic=False)
    packed, d_packed = update_delta(mode, dynamic=True)
    for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"):
        assert packed[key] == pytest.approx(padded[key], abs=1e-6, rel=1e-6), key
    assert padded["actor/grad_norm"] > 1e-3  # the step moved the weights
    for a, b in zip(d_packed, d_padded, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_packed_logprobs_equal_padded() -> None:
    model = build_tiny_model(TinyModelConfig(hidden_size=32, intermediate_size=64), V, seed=1).double().eval()
    r = rows(1)
    batch = pad_rollouts(r["prompt_token_ids"], r["response_token_ids"], pad_id=0)
    padded = compute_logprobs(model, batch, 2, 0.7)  # (N, L)
    packed = compute_logprobs(model, batch, 2, 0.7, max_token_len=15)
    mask = batch["response_mask"].double()
    torch.testing.assert_close(packed * mask, padded * mask, atol=1e-10, rtol=0)
    assert (packed * (1 - mask)).abs().max() == 0  # padding is 0 in the packed path
    # padded tokens: 6 rows x (7 + 6) positions = 78, real 26 + 18 = 44 -> 34 / 78 padding
    assert padding_share(batch["attention_mask"]) == pytest.approx(34 / 78)


def test_ref_and_old_logprob_passes_packed(tiny_checkpoint) -> None:
    """The reference worker and the old_logprobs stage's rows, packed by a token budget, equal their padded
    micro-batches' (float32: 1e-5)."""
    import pandas as pd

    from stages.models.policy import load_policy
    from stages.workers.actor_worker import old_logprob_rows
    from stages.workers.ref_worker import RefWorker

    r = rows(2)
    df = pd.DataFrame(
        {
            "rollout_id": range(len(PROMPT_LENS)),
            "policy_version": 0,
            "prompt_token_ids": r["prompt_token_ids"],
            "response_token_ids": r["response_token_ids"],
        }
    )
    kw = {"model_dir": str(tiny_checkpoint), "ref_policy_version": 0, "micro_batch_size": 2, "temperature": 0.7}
    padded = RefWorker(0, 1, 1, **kw).compute_ref_log_prob(df)["ref_logprobs"]
    packed = RefWorker(0, 1, 1, **kw, max_token_len=16).compute_ref_log_prob(df)["ref_logprobs"]
    model, tok = load_policy(tiny_checkpoint)
    old = old_logprob_rows(model, tok.pad_token_id, df, 2, 0.7, max_token_len=16)["old_logprobs"]
    for a, b, c, n in zip(padded, packed, old, RESPONSE_LENS, strict=True):
        assert len(a) == len(b) == len(c) == n
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(c), torch.tensor(a), atol=1e-5, rtol=0)


def test_config_dynamic_bsz_frees_the_micro_batch_size_and_refuses_megatron() -> None:
    from pydantic import ValidationError

    from configs.schema import load_config

    cfg = load_config(None, ["actor.use_dynamic_bsz=true", "actor.ppo_micro_batch_size=7"])  # 7 divides nothing
    assert cfg.actor.ppo_max_token_len_per_gpu == cfg.actor.log_prob_max_token_len_per_gpu == 16384  # verl's
    with pytest.raises(ValidationError, match="use_dynamic_bsz=True is not supported with actor.strategy='megatron'"):
        ActorConfig(use_dynamic_bsz=True, strategy="megatron")


def _dp_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        model = build_tiny_model(TinyModelConfig(hidden_size=32, intermediate_size=64), V, seed=0).double()
        before = [p.detach().clone() for p in model.parameters()]
        cfg = ActorConfig(loss_agg_mode="seq-mean-token-mean", ppo_mini_batch_size=1, use_dynamic_bsz=True,
                          ppo_max_token_len_per_gpu=12, log_prob_max_token_len_per_gpu=12, entropy_coeff=0.01,
                          use_kl_loss=True)  # fmt: skip
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        mine = slice(3 * rank, 3 * rank + 3)  # shard_for_rank's halves of the one mini-batch of 6 rows
        r = {k: v[mine] for k, v in rows().items()}
        metrics = ppo_update(model, opt, sched, r, cfg, n_per_prompt=6, pad_id=0, temperature=0.7,
                             ddp_model=DistributedDataParallel(model))  # fmt: skip
        if rank == 0:
            torch.save((metrics, [p.detach() - b for p, b in zip(model.parameters(), before, strict=True)]), out)
    finally:
        dist.destroy_process_group()


def test_packed_update_on_two_ranks_equals_one_padded_rank(tmp_path) -> None:
    """Two gloo ranks (DDP), 3 rows each, packed micro-batches by a budget of 12 tokens: rank 0's rows (7 + 7 + 11
    tokens) need 3 micro-batches, rank 1's (3 + 9 + 7) 2, so both run 3 (the max over ranks); the step equals
    one padded rank's over all 6 rows."""
    import torch.multiprocessing as mp

    from stages.io.ports import free_port

    out = tmp_path / "dp.pt"
    mp.spawn(_dp_rank, args=(free_port(), str(out)), nprocs=2, join=True)
    metrics, delta = torch.load(out)
    ref, ref_delta = update_delta("seq-mean-token-mean", dynamic=False)
    for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss"):
        assert metrics[key] == pytest.approx(ref[key], abs=1e-6, rel=1e-6), key
    for a, b in zip(delta, ref_delta, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_flash_varlen_layout_and_gqa() -> None:
    """The GPU kernel's call (flash_varlen): (1, h, T, d) -> (T, h, d) and back, kv heads repeated as transformers'
    repeat_kv when the kernel has no enable_gqa. torch's varlen_attn runs on CUDA only, so a per-sequence causal
    sdpa in its (T, h, d) layout stands in for it here; the result must equal the CPU path (varlen_attention)."""
    from types import SimpleNamespace

    from stages.train.packing import flash_varlen, varlen_attention

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        assert window_size == (-1, 0) and q.shape[1] == k.shape[1], "causal, kv heads already repeated"
        bounds = cu_q.tolist()
        outs = [
            torch.nn.functional.scaled_dot_product_attention(
                *(x[s:e].transpose(0, 1) for x in (q, k, v)), is_causal=True, scale=scale
            ).transpose(0, 1)
            for s, e in zip(bounds[:-1], bounds[1:], strict=True)
        ]
        return torch.cat(outs)

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 9, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 9, 8, generator=g, dtype=torch.float64) for _ in range(2))  # 2 kv heads for 4
    cu = torch.tensor([0, 4, 5, 9], dtype=torch.int32)
    got = flash_varlen((kernel, {"window_size": (-1, 0)}, False), q, k, v, cu, 4, 0.3)  # (1, T, h, d)
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
    want, _ = varlen_attention(module, q, k, v, None, cu_seq_lens_q=cu, scaling=0.3, dropout=0.0)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
