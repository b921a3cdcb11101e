"""Validation metrics over the n responses of each prompt, with verl's semantics and names.

Shape legend: B prompts, G samples per prompt, N = B*G rollouts, P prompt len,
L response len, T = P+L, V vocab. Masks are float {0,1}, 1 = counted in the loss.
Here also: n responses of one prompt, K a bootstrap subset size, S bootstrap draws (1000).

What verl's `process_validation_metrics` and `RayPPOTrainer._val_metrics_update`
(verl/trainer/ppo/metric_utils.py, ray_trainer.py) compute, here vectorized over the draws:

- per prompt and numeric variable (the reward, and each numeric key a scorer returns beside it, such as `acc`):
  mean@n and (n > 1) std@n (population std) of its n values; for K in 2, 4, 8, ... < n and K = n, S = 1000
  bootstrap subsets of K of the n values drawn with replacement give best@K/{mean,std} (of the subset max),
  worst@K/{mean,std} (the min) and, when the scorer returns a `pred` (the extracted answer), maj@K/{mean,std}:
  the value of the first response whose pred is the subset's most frequent one (ties: the pred that appears
  first in the subset). A string variable (pred itself) gets nothing.
- the draws: verl reseeds numpy's global legacy RNG with seed 42 before each (prompt, K) and draws
  `np.random.choice(n, size=(S, K))` (1dda039; older verl: size=K, S times: the same stream);
  `np.random.RandomState(42).randint(0, n, (S, K))` is that stream too, so every prompt with n responses
  uses the same (S, K) index table, as in verl.
- per data source: each metric is the mean over its prompts.
- names (`val_metric_names`): `val-core/<data_source>/<var>/<metric>` for the core variable (`acc` when the
  scorer returns one, else `reward`) and its metrics mean@n, best@n/{mean,std} and maj@n/{mean,std} at the
  largest n;
  `val-aux/<data_source>/<var>/<metric>` for every other one (std@n, worst@*, smaller K, other variables).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

N_BOOTSTRAP = 1000
"""Bootstrap draws per (prompt, subset size), verl's n_bootstrap."""
SEED = 42
"""verl's bootstrap seed (process_validation_metrics' default)."""
CORE_METRICS = ("mean", "maj", "best")
"""Metric families that go to val-core at the largest n (verl's _val_metrics_update)."""


def subset_sizes(n: int) -> list[int]:
    """The bootstrap subset sizes K of a prompt with n > 1 responses: 2, 4, 8, ... below n, then n."""
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return [*sizes, n]


def bootstrap_indices(n: int, k: int, *, n_bootstrap: int = N_BOOTSTRAP, seed: int = SEED) -> np.ndarray:
    """Indices of S = n_bootstrap subsets of k out of n responses, drawn with replacement.

    Returns:
        (S, K) int64 in [0, n): row s is verl's s-th `np.random.choice(n, size=k)` after `np.random.seed(seed)`.
    """
    return np.random.RandomState(seed).randint(0, n, size=(n_bootstrap, k))


def majority_values(values: np.ndarray, votes: np.ndarray) -> np.ndarray:
    """Majority vote per subset (verl's calc_maj_val): the value of the first member whose vote is the most
    frequent in its subset; among equally frequent votes, the one appearing first wins.

    Args:
        values: (S, K) float, the variable's value of each subset member.
        votes: (S, K) int64, each member's pred as a code (equal preds, equal codes).
    Returns:
        (S,) float.
    """
    count = (votes[:, :, None] == votes[:, None, :]).sum(-1)  # (S, K): how often member j's vote occurs
    first = np.argmax(count == count.max(axis=1, keepdims=True), axis=1)  # (S,): first member of a top vote
    return values[np.arange(len(values)), first]


def _mean_std(x: np.ndarray) -> tuple[float, float]:
    return float(np.mean(x)), float(np.std(x))


def prompt_metrics(
    values: np.ndarray, votes: np.ndarray | None, *, n_bootstrap: int = N_BOOTSTRAP, seed: int = SEED
) -> dict[str, float]:
    """verl's metrics of one variable over one prompt's n responses (names without the data source and var).

    Args:
        values: (n,) float, the variable per response.
        votes: (n,) int64 pred codes per response, or None without a pred (then no maj@K).
    Returns:
        {"mean@n", and for n > 1 "std@n", "best@K/mean", "best@K/std", "worst@K/...", "maj@K/..."}.
    """
    n = len(values)
    out = {f"mean@{n}": float(np.mean(values))}
    if n == 1:
        return out
    out[f"std@{n}"] = float(np.std(values))
    for k in subset_sizes(n):
        idx = bootstrap_indices(n, k, n_bootstrap=n_bootstrap, seed=seed)  # (S, K)
        subsets = values[idx]  # (S, K)
        out[f"best@{k}/mean"], out[f"best@{k}/std"] = _mean_std(subsets.max(axis=1))
        out[f"worst@{k}/mean"], out[f"worst@{k}/std"] = _mean_std(subsets.min(axis=1))
        if votes is not None:
            out[f"maj@{k}/mean"], out[f"maj@{k}/std"] = _mean_std(majority_values(subsets, votes[idx]))
    return out


def _codes(preds: Sequence[Any]) -> np.ndarray:
    """(n,) int64: equal preds (None included) get equal codes."""
    seen: dict[Any, int] = {}
    return np.array([seen.setdefault(p, len(seen)) for p in preds], dtype=np.int64)


def _numeric(column: Sequence[Any]) -> np.ndarray | None:
    """(N,) float64 of a variable (None -> NaN), or None for a string variable (verl skips those)."""
    if any(isinstance(v, (str, bytes)) for v in column):
        return None
    return np.array([np.nan if v is None else float(v) for v in column], dtype=np.float64)


def process_validation_metrics(
    data_sources: Sequence[str],
    uids: Sequence[Any],
    infos: dict[str, Sequence[Any]],
    *,
    n_bootstrap: int = N_BOOTSTRAP,
    seed: int = SEED,
) -> dict[str, dict[str, dict[str, float]]]:
    """{data_source: {var: {metric: mean over the source's prompts}}}, verl's process_validation_metrics.

    Args:
        data_sources: (N,) data source of each response.
        uids: (N,) prompt id of each response; a prompt's responses share it.
        infos: {var: (N,) values}: "reward", the scorer's extra keys ("acc", "pred", ...). A "pred" key
            turns on maj@K for every numeric variable.
    """
    rows: dict[str, dict[Any, list[int]]] = {}
    for i, (ds, uid) in enumerate(zip(data_sources, uids, strict=True)):
        rows.setdefault(ds, {}).setdefault(uid, []).append(i)
    numeric = {var: _numeric(col) for var, col in infos.items()}
    preds = infos.get("pred")
    out: dict[str, dict[str, dict[str, float]]] = {}
    for ds, by_uid in rows.items():
        per_var: dict[str, dict[str, list[float]]] = {}
        for idx in by_uid.values():
            votes = None if preds is None else _codes([preds[i] for i in idx])
            for var, col in numeric.items():
                if col is None:
                    continue
                m = prompt_metrics(col[idx], votes, n_bootstrap=n_bootstrap, seed=seed)
                for name, value in m.items():
                    per_var.setdefault(var, {}).setdefault(name, []).append(value)
        out[ds] = {var: {name: float(np.mean(v)) for name, v in ms.items()} for var, ms in per_var.items()}
    return out


def metric_n(name: str) -> int:
    """The n (or K) of a metric name: 8 for "mean@8", 4 for "best@4/std"."""
    return int(name.split("@")[-1].split("/")[0])


def val_metric_names(nested: dict[str, dict[str, dict[str, float]]]) -> dict[str, float]:
    """Flat `val-core/...` / `val-aux/...` names of process_validation_metrics' output, split as verl's
    _val_metrics_update: val-core = the core variable (acc if present, else reward) x mean@n, best@n/* and
    maj@n/* at its largest n (std@n and worst@n are not); val-aux = the rest."""
    flat: dict[str, float] = {}
    for ds, by_var in nested.items():
        core_var = "acc" if "acc" in by_var else "reward"
        for var, metrics in by_var.items():
            n_max = max(metric_n(name) for name in metrics)
            for name, value in metrics.items():
                core = var == core_var and name.startswith(CORE_METRICS) and metric_n(name) == n_max
                flat[f"{'val-core' if core else 'val-aux'}/{ds}/{var}/{name}"] = value
    return flat
