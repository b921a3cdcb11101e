"""Before/after numbers of docs/verl_parity.md (items 1-4): on the toy batch of
tests/stages/test_loss_aggregation.py, the relative difference of each loss term and of the gradient from
verl >= 0.8's aggregation (the whole mini-batch on one rank, which that test proves equal to every
micro-batch / DP split of this checkout), for rlake before the change and after it.

    git worktree add /tmp/rlake-before 9085347      # the last commit before the change
    python scripts/verl_parity_numbers.py /tmp/rlake-before

Prints one JSON line per (loss_mode, loss_agg_mode, micro-batches or DP ranks, before/after).
"""

import importlib
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BEFORE = sys.argv[1] if len(sys.argv) > 1 else "/tmp/rlake-before"


def load(root):
    for m in [k for k in sys.modules if k.split(".")[0] in ("stages", "configs")]:
        del sys.modules[m]
    sys.path.insert(0, root)
    mods = {n: importlib.import_module(n) for n in ("stages.train.ppo_loop", "configs.schema", "stages.algos.losses")}
    sys.path.pop(0)
    return mods


sys.path.insert(0, str(ROOT / "tests" / "stages"))
import test_loss_aggregation as T  # the toy model and batch


def terms(mods, mode, loss_mode, n_micro, new):
    pl, sc = mods["stages.train.ppo_loop"], mods["configs.schema"]
    kw = dict(
        loss_agg_mode=mode,
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        kl_loss_type="low_var_kl",
        policy_loss=sc.PolicyLossConfig(loss_mode=loss_mode),
    )
    if new:
        kw["loss_scale_factor"] = T.L
    cfg = sc.ActorConfig(**kw)
    model = T.Toy(T.V)
    batch = T.toy_batch()
    acc = pl.MetricAccumulator()
    micro = list(torch.arange(T.N).split(T.N // n_micro))
    if new:
        pl.accumulate_grads(batch, micro, lambda mb, gb: pl.actor_loss(model(mb["prev"]), mb, cfg, gb), acc)
    else:
        pl.accumulate_grads(batch, micro, lambda mb, model=model: pl.actor_loss(model(mb["prev"]), mb, cfg), acc)
    m = acc.means()
    return {k: m[k] for k in ("actor/pg_loss", "actor/entropy", "actor/kl_loss")}, model.w.grad.clone()


old, new = load(BEFORE), load(str(ROOT))
rows = []
for loss_mode, modes in (
    ("vanilla", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]),
    ("gspo", ["token-mean"]),
):
    for mode in modes:
        ref, gref = terms(new, mode, loss_mode, 1, True)
        for n_micro in (1, 2, 4):
            for tag, mods, isnew in (("before", old, False), ("after", new, True)):
                t, g = terms(mods, mode, loss_mode, n_micro, isnew)
                rel = {k.split("/")[1]: abs(t[k] - ref[k]) / abs(ref[k]) for k in t}
                rows.append(
                    dict(
                        loss_mode=loss_mode,
                        mode=mode,
                        n_micro=n_micro,
                        code=tag,
                        **{f"{k}_reldiff": round(v, 6) for k, v in rel.items()},
                        grad_reldiff=round(float((g - gref).norm() / gref.norm()), 6),
                    )
                )
for r in rows:
    print(json.dumps(r))


# DP 2 (before): each rank's half in 2 micro-batches, DDP averages the ranks' gradients and the metrics
def old_dp(mode, loss_mode):
    pl, sc = old["stages.train.ppo_loop"], old["configs.schema"]
    cfg = sc.ActorConfig(
        loss_agg_mode=mode,
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        kl_loss_type="low_var_kl",
        policy_loss=sc.PolicyLossConfig(loss_mode=loss_mode),
    )
    grads, ms = [], []
    for rank in range(2):
        model = T.Toy(T.V)
        rows = torch.arange(rank * T.N // 2, (rank + 1) * T.N // 2)
        batch = {k: v[rows] for k, v in T.toy_batch().items()}
        acc = pl.MetricAccumulator()
        pl.accumulate_grads(
            batch,
            list(torch.arange(4).split(2)),
            lambda mb, model=model: pl.actor_loss(model(mb["prev"]), mb, cfg),
            acc,
        )
        grads.append(model.w.grad.clone())
        ms.append(acc.means())
    return {k: (ms[0][k] + ms[1][k]) / 2 for k in ms[0]}, (grads[0] + grads[1]) / 2


for loss_mode, mode in (
    ("vanilla", "token-mean"),
    ("vanilla", "seq-mean-token-sum"),
    ("vanilla", "seq-mean-token-mean"),
    ("vanilla", "seq-mean-token-sum-norm"),
    ("gspo", "token-mean"),
):
    ref, gref = terms(new, mode, loss_mode, 1, True)
    m, g = old_dp(mode, loss_mode)
    print(
        json.dumps(
            dict(
                loss_mode=loss_mode,
                mode=mode,
                dp=2,
                code="before",
                **{f"{k.split('/')[1]}_reldiff": round(abs(m[k] - ref[k]) / abs(ref[k]), 6) for k in ref},
                grad_reldiff=round(float((g - gref).norm() / gref.norm()), 6),
            )
        )
    )
