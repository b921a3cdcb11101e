"""verl >= 0.8 loss aggregation in the trainer: a mini-batch's loss and gradient do not depend on how it is
cut into micro-batches (1, 2, 4) or data-parallel ranks (1 vs 2, DDP over gloo), for every loss_agg_mode,
for the policy loss with entropy bonus and KL loss (vanilla and gspo) and for the critic's value loss.

The model is a toy: logits (or values) of a position are a trainable linear map of a fixed embedding of
the previous token, so the test runs the real accumulate_grads / actor_loss / critic_loss / DDP path in
milliseconds. The batch has rows of different lengths and one fully masked row (item 3 of issue #15: it counts in
the seq-mean modes' row count, as in verl's trainer).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from configs.schema import ActorConfig, CriticConfig, PolicyLossConfig
from stages.algos.losses import LOSS_AGG_MODES, GlobalBatch, aggregate_loss, entropy_from_logits
from stages.io.ports import free_port
from stages.train.ppo_loop import MetricAccumulator, accumulate_grads, actor_loss, critic_loss, mean_over_workers

N, L, V, D = 8, 6, 11, 5
LENGTHS = [6, 1, 3, 0, 5, 2, 6, 4]  # row 3 is fully masked


class Toy(torch.nn.Module):
    """logits/values (n, L, out) = emb[prev] @ W: prev (n, L) token ids."""

    def __init__(self, out: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.emb = torch.randn(V, D, generator=g, dtype=torch.float64)
        self.w = torch.nn.Parameter(torch.randn(D, out, generator=g, dtype=torch.float64) * 0.5)

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        return self.emb[prev] @ self.w


def toy_batch() -> dict:
    g = torch.Generator().manual_seed(2)
    mask = (torch.arange(L)[None, :] < torch.tensor(LENGTHS)[:, None]).double()  # (N, L)
    return {
        "prev": torch.randint(0, V, (N, L), generator=g),
        "responses": torch.randint(0, V, (N, L), generator=g),
        "response_mask": mask,
        "old_logprobs": -torch.rand(N, L, generator=g, dtype=torch.float64) * 3,
        "ref_logprobs": -torch.rand(N, L, generator=g, dtype=torch.float64) * 3,
        "advantages": torch.randn(N, 1, generator=g, dtype=torch.float64).expand(N, L) * mask,
        "returns": torch.randn(N, L, generator=g, dtype=torch.float64) * mask,
        "old_values": torch.randn(N, L, generator=g, dtype=torch.float64) * mask,
    }


def actor_cfg(mode: str, loss_mode: str = "vanilla") -> ActorConfig:
    return ActorConfig(
        loss_agg_mode=mode,
        loss_scale_factor=L,
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        kl_loss_type="low_var_kl",
        policy_loss=PolicyLossConfig(loss_mode=loss_mode),
    )


def run(role: str, cfg, rows: torch.Tensor, n_micro: int, dp: int = 1, model=None) -> tuple[dict, torch.Tensor]:
    """Metrics and gradient of one mini-batch made of `rows` of the toy batch, cut into n_micro micro-batches."""
    model = model or Toy(V if role == "actor" else 1)
    train = DistributedDataParallel(model) if dp > 1 else model
    batch = {k: v[rows] for k, v in toy_batch().items()}

    def loss_fn(mb: dict, gb: GlobalBatch):
        out = train(mb["prev"])
        if role == "actor":
            return actor_loss(out, mb, cfg, gb)
        return critic_loss(out[..., 0], mb, cfg, gb)

    acc = MetricAccumulator()
    micro = list(torch.arange(len(rows)).split(len(rows) // n_micro))
    no_sync = train.no_sync if dp > 1 else None
    accumulate_grads(batch, micro, loss_fn, acc, dp_size=dp, no_sync=no_sync)
    return mean_over_workers(acc.means(), dp), model.w.grad.clone()


CASES = [("actor", m, "vanilla") for m in LOSS_AGG_MODES] + [("actor", "token-mean", "gspo")]
CASES += [("critic", m, None) for m in LOSS_AGG_MODES]


def cfg_of(role: str, mode: str, loss_mode: str | None):
    return actor_cfg(mode, loss_mode) if role == "actor" else CriticConfig(loss_agg_mode=mode, loss_scale_factor=L)


LOSS_KEYS = {"actor": ("actor/pg_loss", "actor/entropy", "actor/kl_loss"), "critic": ("critic/vf_loss",)}


@pytest.mark.parametrize(("role", "mode", "loss_mode"), CASES)
def test_loss_and_gradient_do_not_depend_on_micro_batches(role: str, mode: str, loss_mode: str | None) -> None:
    cfg = cfg_of(role, mode, loss_mode)
    rows = torch.arange(N)
    ref_metrics, ref_grad = run(role, cfg, rows, 1)
    assert ref_grad.abs().sum() > 0
    for n_micro in (2, 4):
        metrics, grad = run(role, cfg, rows, n_micro)
        for key in LOSS_KEYS[role]:
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-12, abs=1e-14), (key, n_micro)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-14)


def test_one_micro_batch_is_the_whole_batch_formula() -> None:
    """With one micro-batch the terms are verl's agg_loss on the whole batch; by hand for the entropy term:
    token-mean = sum(H * mask) / sum(mask); seq-mean-token-sum = sum over rows of the row's token sum / 8 rows
    (row 3 has no token and adds 0, but counts: verl's trainer divides by global_batch_size = ppo_mini_batch_size
    x rollout.n, every row of the mini-batch); seq-mean-token-sum-norm = the same / L; seq-mean-token-mean = sum
    of the 7 non-empty rows' means / 8."""
    batch = toy_batch()
    model = Toy(V)
    with torch.no_grad():
        ent = entropy_from_logits(model(batch["prev"]))  # (N, L)
    mask = batch["response_mask"]
    row_sum = (ent * mask).sum(-1)
    assert int((mask.sum(-1) > 0).sum()) == 7 and len(mask) == N == 8
    want = {
        "token-mean": float((ent * mask).sum() / mask.sum()),
        "seq-mean-token-sum": float(row_sum.sum() / 8),
        "seq-mean-token-sum-norm": float(row_sum.sum() / 8 / L),
        "seq-mean-token-mean": float((row_sum / mask.sum(-1).clamp(min=1)).sum() / 8),
    }
    for mode, value in want.items():
        metrics, _ = run("actor", actor_cfg(mode), torch.arange(N), 1, model=Toy(V))
        assert metrics["actor/entropy"] == pytest.approx(value, rel=1e-12), mode
        assert float(aggregate_loss(ent, mask, mode, norm_length=L)) == pytest.approx(value, rel=1e-12)


def _dp_rank(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        results = {}
        for role, mode, loss_mode in CASES:
            rows = torch.arange(rank * N // 2, (rank + 1) * N // 2)  # contiguous halves, as shard_for_rank
            results[(role, mode, loss_mode)] = run(role, cfg_of(role, mode, loss_mode), rows, 2, dp=2)
            # unequal shares (a batch that lost flagged rollouts: shard_for_rank gives 3 and 5 rows)
            rows = torch.arange(0, 3) if rank == 0 else torch.arange(3, N)
            results[("unequal", role, mode, loss_mode)] = run(role, cfg_of(role, mode, loss_mode), rows, 1, dp=2)
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def test_loss_and_gradient_are_the_same_on_two_data_parallel_ranks(tmp_path) -> None:
    """Two gloo ranks, each with half the mini-batch in 2 micro-batches, DDP averaging the gradients: the same
    loss metrics and gradient as one rank with the whole mini-batch in one micro-batch (the rank halves
    have different token and non-empty row counts: 10 tokens / 3 non-empty rows of 4 vs 17 / 4 of 4)."""
    out = tmp_path / "dp.pt"
    mp.spawn(_dp_rank, args=(free_port(), str(out)), nprocs=2, join=True)
    got = torch.load(out)
    for role, mode, loss_mode in CASES:
        metrics, grad = got[(role, mode, loss_mode)]
        ref_metrics, ref_grad = run(role, cfg_of(role, mode, loss_mode), torch.arange(N), 1)
        for key in LOSS_KEYS[role]:
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-12, abs=1e-14), (role, mode, key)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-14)
        metrics, grad = got[("unequal", role, mode, loss_mode)]  # ranks holding 3 and 5 rows of the mini-batch
        for key in LOSS_KEYS[role]:
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-12, abs=1e-14), ("unequal", role, key)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-14)
