"""verl's critic data metrics (`compute_data_metrics`, its critic part) as mergeable moments, so a stream of
batches gives the numbers of the whole batch without holding it.

Shape legend: B prompts, G samples per prompt, N = B*G rollouts, P prompt len,
L response len, T = P+L, V vocab. Masks are float {0,1}, 1 = counted in the loss.
Here K = the counted response tokens of a batch of rollouts (the (N, L) mask's ones: a model token of a response;
an observation token of a multi-turn rollout is not counted), flattened row after row.

Over all counted tokens of the iteration: critic/{values,returns,advantages}/{mean,max,min} and
critic/vf_explained_var = 1 - Var(returns - values) / (Var(returns) + 1e-5), each variance unbiased (Bessel's
n / (n - 1) when n >= 2, as stages.algos.masking.masked_var). The variances are merged with Chan's pairwise
update (count, mean, sum of squared deviations), in float64. No counted token: means, max and min 0 and
vf_explained_var 1 (as masked_mean and masked_var give on an empty mask).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

NAMES = ("values", "returns", "advantages")
EPS = 1e-5
"""verl's guard in vf_explained_var's denominator."""


@dataclass
class Moments:
    """count, mean and sum of squared deviations (M2) of a stream of numbers."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, x: np.ndarray) -> None:
        """Merge the numbers x (K,) in (Chan et al.'s pairwise update)."""
        if not len(x):
            return
        x = np.asarray(x, dtype=np.float64)
        n_b, mean_b = len(x), float(x.mean())
        m2_b = float(((x - mean_b) ** 2).sum())
        n = self.n + n_b
        delta = mean_b - self.mean
        self.mean += delta * n_b / n
        self.m2 += m2_b + delta * delta * self.n * n_b / n
        self.n = n

    def var(self) -> float:
        """Unbiased variance (a single number or none: 0, as masked_var)."""
        return self.m2 / (self.n - 1) if self.n > 1 else 0.0


@dataclass
class CriticDataMoments:
    """The critic data metrics of every batch added so far."""

    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(NAMES, 0.0))
    maxs: dict[str, float] = field(default_factory=lambda: dict.fromkeys(NAMES, -np.inf))
    mins: dict[str, float] = field(default_factory=lambda: dict.fromkeys(NAMES, np.inf))
    count: int = 0
    returns: Moments = field(default_factory=Moments)
    residual: Moments = field(default_factory=Moments)

    def add(self, values: np.ndarray, returns: np.ndarray, advantages: np.ndarray) -> None:
        """One batch's counted tokens.

        Args:
            values: (K,) the critic's values of the batch's counted tokens.
            returns: (K,) their GAE returns.
            advantages: (K,) their token advantages.
        """
        cols = {name: np.asarray(x, dtype=np.float64) for name, x in zip(NAMES, (values, returns, advantages))}
        if not len(cols["values"]):
            return
        for name, x in cols.items():
            self.sums[name] += float(x.sum())
            self.maxs[name] = max(self.maxs[name], float(x.max()))
            self.mins[name] = min(self.mins[name], float(x.min()))
        self.count += len(cols["values"])
        self.returns.add(cols["returns"])
        self.residual.add(cols["returns"] - cols["values"])

    def metrics(self) -> dict[str, float]:
        """verl's names: critic/<name>/mean|max|min and critic/vf_explained_var."""
        out: dict[str, float] = {}
        for name in NAMES:
            seen = self.count > 0
            out[f"critic/{name}/mean"] = self.sums[name] / self.count if seen else 0.0
            out[f"critic/{name}/max"] = self.maxs[name] if seen else 0.0
            out[f"critic/{name}/min"] = self.mins[name] if seen else 0.0
        out["critic/vf_explained_var"] = 1.0 - self.residual.var() / (self.returns.var() + EPS)
        return out
