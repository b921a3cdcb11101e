"""Rollout correction: importance weights and rejection sampling for the gap between the rollout engine's
sampling probabilities and the trainer's (verl's `algorithm.rollout_correction`, decoupled mode,
`verl/trainer/ppo/rollout_corr_helper.py` at verl-project/verl 1dda039).

Shape legend: B prompts, G samples per prompt, N = B*G rollouts, P prompt len,
L response len, T = P+L, V vocab. Masks are float {0,1}, 1 = counted in the loss.

log r_t = old_logprobs - rollout_logprobs: the trainer's (recomputed before the update) over the engine's
log-prob of each sampled token (Liu, Li et al. 2025, "When Speed Kills Stability",
https://richardli.xyz/rl-collapse; Yao et al. 2025, https://fengyao.notion.site/off-policy-rl).
- Importance weights (`rollout_is`): token w_t = r_t; sequence w_t = prod_s r_s over the rollout's counted
  tokens, the same on each of its tokens; the log is clamped to [-20, 20] before exp, padding gets 0. TIS
  (one `upper` bound) truncates: min(w, upper); IcePop (`lower` and `upper`) zeroes the weights outside
  [lower, upper] and keeps the others. Detached: they change the measure, not the objective. The policy loss
  multiplies its per-token loss by them before aggregation (losses.py); the normalizer is unchanged.
- Rejection sampling (`rollout_rs`): per option a statistic of log r, k1 = -log r, k2 = (log r)^2 / 2 or
  k3 = r - 1 - log r, per token (token_*) or the rollout's sum / mean / max of it (seq_*); a token, or every
  token of a rollout, outside the bounds leaves the response mask (k1: log(lower) <= stat <= log(upper), which
  is lower <= 1/r <= upper as in verl; k2, k3: stat <= upper). Options are ANDed; geometric (seq_mean_k1)
  rejection and the max-criterion veto (seq_max_k2 / _k3) are options.
- Metrics: verl's names under `rollout_corr/`, computed on the original mask. Means over tokens and rows use
  verl's masked mean (sum / (count + 1e-8)); a statistic over an empty set is 0 (verl raises on a batch without
  a counted token; rlake trains on it as usual).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

SAFETY_BOUND = 20.0
"""log-ratios (and their sums) are clamped to [-20, 20] before exp (verl)."""
PREFIX = "rollout_corr/"
RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)


def _mmean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """verl's masked_mean: sum(values * mask) / (count + 1e-8), over `dim` or everything."""
    if dim is None:
        return (values * mask).sum() / (mask.sum() + 1e-8)
    return (values * mask).sum(dim) / (mask.sum(dim) + 1e-8)


def _extreme(values: Tensor, mask: Tensor, *, largest: bool) -> float:
    """max (largest) or min of values where mask is 1; 0.0 when there is none."""
    keep = mask.bool()
    if not keep.any():
        return 0.0
    return float(values[keep].max() if largest else values[keep].min())


def _var_std(values: Tensor, mask: Tensor) -> float:
    """sqrt(E[v^2] - E[v]^2) under the mask (verl's std of a metric), 0.0 with fewer than 2 counted entries."""
    if float(mask.sum()) <= 1:
        return 0.0
    return float((_mmean(values.square(), mask) - _mmean(values, mask).square()).clamp(min=0.0).sqrt())


def _seq_summary(prefix: str, seq: Tensor, hi: float, lo: float | None, reference: float) -> dict[str, float]:
    """verl's per-rollout summary of a statistic seq (n,): mean, std (unbiased), max, min, the largest distance
    to `reference`, the shares above hi and (lo given) below lo; zeros when n = 0."""
    if seq.numel() == 0:
        out = dict.fromkeys(("seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation"), 0.0)
        return {f"{prefix}_{k}": v for k, v in {**out, "seq_fraction_high": 0.0}.items()}
    out = {
        "seq_mean": float(seq.mean()),
        "seq_std": float(seq.std()) if seq.numel() > 1 else 0.0,
        "seq_max": float(seq.max()),
        "seq_min": float(seq.min()),
        "seq_max_deviation": float((seq - reference).abs().max()),
        "seq_fraction_high": float((seq > hi).float().mean()),
    }
    return {f"{prefix}_{k}": v for k, v in out.items()}


def compute_rollout_is_weights(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor,
    *,
    level: str = "token",
    upper: float = 2.0,
    lower: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Truncated (TIS) or bounded (IcePop) importance weights pi_trainer / pi_engine (verl's
    compute_rollout_correction_weights).

    Args:
        old_logprobs: (N, L) the trainer's log-probs of the sampled tokens.
        rollout_logprobs: (N, L) the engine's log-probs of the same tokens.
        response_mask: (N, L) float {0,1}.
        level: "token" (w_t = r_t) or "sequence" (w_t = prod over the rollout's counted tokens).
        upper: the truncation bound (TIS), or IcePop's upper bound when lower is given.
        lower: None = TIS; else IcePop: weights outside [lower, upper] become 0.
    Returns:
        (weights (N, L) detached, 0 on padding; rollout_corr/rollout_is_* metrics).
    """
    assert old_logprobs.shape == rollout_logprobs.shape == response_mask.shape, (
        f"{old_logprobs.shape=} {rollout_logprobs.shape=} {response_mask.shape=}"
    )
    if level not in ("token", "sequence"):
        raise ValueError(f"Unknown rollout_is level '{level}'. Valid: ['token', 'sequence']")
    log_ratio = old_logprobs - rollout_logprobs  # (N, L)
    if level == "token":
        log_for_metrics = log_ratio
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))  # (N, L)
    else:
        log_for_metrics = (log_ratio * response_mask).sum(-1, keepdim=True)  # (N, 1) log prod_t r_t
        raw = torch.exp(log_for_metrics.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)  # (N, L)
    raw = raw * response_mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    metrics = rollout_is_metrics(weights, raw, log_for_metrics, response_mask, level=level, upper=upper, lower=lower)
    return weights.detach(), metrics


def rollout_is_metrics(
    weights: Tensor,
    raw: Tensor,
    log_for_metrics: Tensor,
    response_mask: Tensor,
    *,
    level: str,
    upper: float,
    lower: float | None = None,
) -> dict[str, float]:
    """verl's compute_is_metrics: mean / max / min of the weights, shares of raw ratios above upper and below
    lower (1 / upper for TIS), std and effective sample size of the weights clipped to [0, upper], per-rollout
    means, and IcePop's out-of-bounds share.

    Args:
        weights: (N, L) the applied weights; raw: (N, L) before truncation / IcePop (0 on padding).
        log_for_metrics: (N, L) token log-ratios (token level) or (N, 1) their sums per rollout (sequence level).
        response_mask: (N, L) float {0,1}.
    """
    lo = 1.0 / upper if lower is None else lower
    mask = response_mask
    m = {"rollout_is_mean": float(_mmean(weights, mask))}
    if level == "sequence":  # over every row, empty ones too (log sum 0), from the unclamped log sums (verl)
        m["rollout_is_max"] = math.exp(min(float(log_for_metrics.max()), SAFETY_BOUND))
        m["rollout_is_min"] = math.exp(float(log_for_metrics.min()))
        m["rollout_is_ratio_fraction_high"] = float((log_for_metrics > math.log(upper)).float().mean())
        m["rollout_is_ratio_fraction_low"] = float((log_for_metrics < math.log(lo)).float().mean())
    else:
        m["rollout_is_ratio_fraction_high"] = float(_mmean((raw > upper).float(), mask))
        m["rollout_is_ratio_fraction_low"] = float(_mmean((raw < lo).float(), mask))
        m["rollout_is_max"] = _extreme(weights, mask, largest=True)
        m["rollout_is_min"] = _extreme(weights, mask, largest=False)
    clipped = weights.clamp(0.0, upper)  # (N, L)
    m["rollout_is_std"] = _var_std(clipped, mask)
    second = float(_mmean((clipped / (_mmean(clipped, mask) + 1e-8)).square(), mask))
    m["rollout_is_eff_sample_size"] = 1.0 / second if second > 0 else 0.0
    m |= _seq_summary("rollout_is", _mmean(weights, mask, -1), math.inf, None, 1.0)  # (N,) per-rollout means
    raw_seq = _mmean(raw, mask, -1)  # (N,) the shares use the raw means: a truncated mean never exceeds upper
    m["rollout_is_seq_fraction_high"] = float((raw_seq > upper).float().mean()) if raw_seq.numel() else 0.0
    m["rollout_is_seq_fraction_low"] = float((raw_seq < lo).float().mean()) if raw_seq.numel() else 0.0
    if lower is not None:
        m["rollout_is_oob_ratio"] = float(_mmean(((raw < lower) | (raw > upper)).float(), mask))
    return {PREFIX + k: v for k, v in m.items()}


def rollout_is_norm_terms(weights: Tensor, response_mask: Tensor, level: str) -> Tensor:
    """(2,) float64 [sum, count] whose ratio is the batch mean that rollout_is_batch_normalize divides by: the
    mean weight over counted tokens (token level), or over non-empty rollouts of their token-mean weight
    (sequence level), as verl. Summed over data-parallel ranks before batch_normalize_weights.

    Args:
        weights: (N, L) compute_rollout_is_weights' weights; response_mask: (N, L) float {0,1}.
    """
    if level == "token":
        return torch.stack([(weights * response_mask).sum(), response_mask.sum()]).double().cpu()
    nonempty = (response_mask.sum(-1) > 0).float()  # (N,)
    per_row = _mmean(weights, response_mask, -1)  # (N,)
    return torch.stack([(per_row * nonempty).sum(), nonempty.sum()]).double().cpu()


def batch_normalize_weights(weights: Tensor, norm_terms: Tensor) -> tuple[Tensor, dict[str, float]]:
    """weights (N, L) divided by the batch mean norm_terms[0] / norm_terms[1] ((2,), rollout_is_norm_terms summed
    over the ranks) unless it is <= 1e-8; metric rollout_corr/rollout_is_batch_norm_factor (1.0 when skipped)."""
    mean = float(norm_terms[0]) / max(float(norm_terms[1]), 1e-8)
    if mean <= 1e-8:
        return weights, {PREFIX + "rollout_is_batch_norm_factor": 1.0}
    return weights / mean, {PREFIX + "rollout_is_batch_norm_factor": mean}


def _rs_statistic(option: str, log_ratio: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor | None]:
    """(the option's statistic per token (N, L): a seq_* option's per-rollout value on each of its tokens;
    the per-rollout value (N,), None for token_* options). A rollout without counted tokens gets 0."""
    lr = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)  # (N, L)
    kind = option[-2:]
    tok = -lr if kind == "k1" else 0.5 * lr.square() if kind == "k2" else torch.exp(lr) - 1.0 - lr
    if option.startswith("token_"):
        return tok, None
    agg = option.split("_")[1]
    if agg == "sum":
        seq = (tok * response_mask).sum(-1)  # (N,)
    elif agg == "mean":
        seq = _mmean(tok, response_mask, -1)  # (N,)
    else:
        seq = tok.masked_fill(~response_mask.bool(), float("-inf")).amax(-1)  # (N,)
        seq = torch.where(torch.isneginf(seq), torch.zeros_like(seq), seq)
    return seq[:, None].expand_as(tok), seq


def _rs_option_metrics(
    option: str, stat: Tensor, seq: Tensor | None, keep: Tensor, response_mask: Tensor, lo: float | None, hi: float
) -> dict[str, float]:
    """verl's compute_rs_metrics for one option plus its masked fractions (keys rollout_rs_<option>_*).
    stat (N, L), seq (N,) or None, keep (N, L) float {0,1}; lo / hi: the bounds on stat (lo only for k1)."""
    p, mask = f"rollout_rs_{option}", response_mask
    valid = mask.sum(-1) > 0  # (N,)
    seq_vals = (seq if seq is not None else _mmean(stat, mask, -1))[valid]  # (n_valid,)
    m = {f"{p}_mean": float(_mmean(stat, mask))}
    if seq is not None and seq_vals.numel():
        m[f"{p}_max"], m[f"{p}_min"] = float(seq_vals.max()), float(seq_vals.min())
        m[f"{p}_fraction_high"] = float((seq_vals > hi).float().mean())
        m[f"{p}_fraction_low"] = float((seq_vals < lo).float().mean()) if lo is not None else 0.0
    else:
        m[f"{p}_max"], m[f"{p}_min"] = _extreme(stat, mask, largest=True), _extreme(stat, mask, largest=False)
        m[f"{p}_fraction_high"] = float(_mmean((stat > hi).float(), mask))
        m[f"{p}_fraction_low"] = float(_mmean((stat < lo).float(), mask)) if lo is not None else 0.0
    m[f"{p}_std"] = _var_std(stat.clamp(lo if lo is not None else 0.0, hi), mask)
    m |= _seq_summary(p, seq_vals, hi, lo, 0.0)
    if lo is not None:
        m[f"{p}_seq_fraction_low"] = float((seq_vals < lo).float().mean()) if seq_vals.numel() else 0.0
    m[f"{p}_masked_fraction"] = float(_mmean(1.0 - keep, mask))
    rejected = ((keep < 0.5) & mask.bool()).any(-1)  # (N,) rollouts that lost a counted token
    m[f"{p}_seq_masked_fraction"] = float(rejected[valid].float().mean()) if valid.any() else 0.0
    return m


def compute_rollout_rs_mask(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor,
    bounds: dict[str, tuple[float | None, float]],
) -> tuple[Tensor, dict[str, float]]:
    """Rejection sampling (verl's compute_rollout_rejection_mask): the response mask without the tokens or
    rollouts that some option rejects.

    Args:
        old_logprobs, rollout_logprobs, response_mask: (N, L) as compute_rollout_is_weights.
        bounds: {option in RS_OPTIONS: (lower, upper)}: k1 options bound the ratio (lower None = 1 / upper),
            k2 / k3 options bound the divergence from above (lower ignored).
    Returns:
        (response_mask * keep (N, L); rollout_corr/rollout_rs_* metrics per option and overall).
    """
    assert old_logprobs.shape == rollout_logprobs.shape == response_mask.shape, (
        f"{old_logprobs.shape=} {rollout_logprobs.shape=} {response_mask.shape=}"
    )
    log_ratio = old_logprobs - rollout_logprobs  # (N, L)
    keep_all = torch.ones_like(response_mask)  # (N, L)
    metrics: dict[str, float] = {}
    for option, (lower, upper) in bounds.items():
        if option not in RS_OPTIONS:
            raise ValueError(f"Unknown rollout_rs option '{option}'. Valid: {list(RS_OPTIONS)}")
        stat, seq = _rs_statistic(option, log_ratio, response_mask)
        if option.endswith("k1"):
            lo, hi = math.log(lower if lower is not None else 1.0 / upper), math.log(upper)
            keep = ((stat >= lo) & (stat <= hi)).to(response_mask.dtype)
        else:
            lo, hi = None, upper
            keep = (stat <= hi).to(response_mask.dtype)
        metrics |= _rs_option_metrics(option, stat, seq, keep, response_mask, lo, hi)
        keep_all = keep_all * keep
    metrics["rollout_rs_masked_fraction"] = float(_mmean(1.0 - keep_all, response_mask))
    rejected = ((keep_all < 0.5) & response_mask.bool()).any(-1)  # (N,)
    metrics["rollout_rs_seq_masked_fraction"] = float(rejected.float().mean()) if rejected.numel() else 0.0
    return response_mask * keep_all, {PREFIX + k: v for k, v in metrics.items()}


def compute_offpolicy_metrics(
    old_logprobs: Tensor, rollout_logprobs: Tensor, response_mask: Tensor
) -> dict[str, float]:
    """verl's off-policy diagnostics (compute_offpolicy_metrics): perplexities of both policies (batch means of
    per-rollout exp(-mean log-prob)), KL(engine || trainer) (k1 and k3 estimates), log-perplexity differences,
    and chi-square divergences E[r^2] - 1 per token and E[(prod r)^2] - 1 per rollout.

    Args:
        old_logprobs, rollout_logprobs, response_mask: (N, L) as compute_rollout_is_weights.
    """
    mask = response_mask
    lp_train, lp_engine = _mmean(old_logprobs, mask, -1), _mmean(rollout_logprobs, mask, -1)  # (N,) each
    log_ratio = old_logprobs - rollout_logprobs  # (N, L)
    log_ppl_diff = lp_engine - lp_train  # (N,)
    seq_log_ratio = (log_ratio * mask).sum(-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # (N,)
    m = {
        "training_ppl": torch.exp(-lp_train).mean(),
        "training_log_ppl": (-lp_train).mean(),
        "kl": _mmean(rollout_logprobs - old_logprobs, mask),
        "k3_kl": _mmean(torch.exp(log_ratio) - log_ratio - 1.0, mask),
        "rollout_ppl": torch.exp(-lp_engine).mean(),
        "rollout_log_ppl": (-lp_engine).mean(),
        "log_ppl_diff": log_ppl_diff.mean(),
        "log_ppl_abs_diff": log_ppl_diff.abs().mean(),
        "log_ppl_diff_max": log_ppl_diff.max(),
        "log_ppl_diff_min": log_ppl_diff.min(),
        "ppl_ratio": torch.exp(log_ppl_diff).mean(),
        "chi2_token": _mmean(torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)).square(), mask) - 1.0,
        "chi2_seq": torch.exp(2.0 * seq_log_ratio).mean() - 1.0,
    }
    return {PREFIX + k: float(v) for k, v in m.items()}


def compute_rollout_correction(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    response_mask: Tensor,
    *,
    rollout_is: str | None = None,
    is_bounds: tuple[float | None, float] = (None, 2.0),
    rs_bounds: dict[str, tuple[float | None, float]] | None = None,
) -> tuple[Tensor | None, Tensor, dict[str, float]]:
    """Importance weights (rollout_is not None), rejection mask (rs_bounds non-empty) and every metric, as
    verl's compute_rollout_correction_and_rejection_mask (without batch normalization, which needs the whole
    batch: rollout_is_norm_terms, batch_normalize_weights).

    Args:
        old_logprobs, rollout_logprobs, response_mask: (N, L) as compute_rollout_is_weights.
        rollout_is: None, "token" or "sequence"; is_bounds: (lower, upper), lower None = TIS.
        rs_bounds: as compute_rollout_rs_mask's bounds; None or {} = no rejection.
    Returns:
        (weights (N, L) or None, response mask after rejection (N, L), metrics under rollout_corr/).
    """
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None:
        lower, upper = is_bounds
        weights, metrics = compute_rollout_is_weights(
            old_logprobs, rollout_logprobs, response_mask, level=rollout_is, upper=upper, lower=lower
        )
    mask = response_mask
    if rs_bounds:
        mask, rs_metrics = compute_rollout_rs_mask(old_logprobs, rollout_logprobs, response_mask, rs_bounds)
        metrics |= rs_metrics
    return weights, mask, metrics | compute_offpolicy_metrics(old_logprobs, rollout_logprobs, response_mask)
