"""Turn rollout rows (token-id lists) into the padded tensors the trainer and engines use.

Layout (verl's): prompts left-padded to P, responses right-padded to L, so the logits at
positions P-1 .. P+L-2 predict the L response tokens of every row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from stages.algos.losses import at_least_float32
from stages.train.precision import autocast

if TYPE_CHECKING:
    import pandas as pd


def is_null(value) -> bool:
    """Whether a cell read from a table is missing: None, or pandas' NaN for a missing object."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def row_masks(column) -> list[list[int] | None] | None:
    """The per-row response masks (rollouts' `response_mask`: 1 = model token, 0 = observation token) of a
    column that may be missing (None) or null in some rows (a null row is all ones): N lists of ints or None,
    or None when no row has one (every single-turn run), so callers keep their all-ones fast path."""
    if column is None:
        return None
    masks = [None if is_null(m) else [int(v) for v in m] for m in column]
    return masks if any(m is not None for m in masks) else None


def loss_mask(lengths: Sequence[int], width: int, masks: Sequence[Sequence[int] | None] | None = None) -> Tensor:
    """(N, width) float {0,1}: 1 on each row's first lengths[i] tokens, times its response mask when given
    (masks: N lists of len lengths[i] 0/1 values or None = all ones; see row_masks). A mask of another length
    than its response, or with other values than 0 and 1, is a ValueError."""
    lengths_t = torch.as_tensor(list(lengths), dtype=torch.long)  # (N,)
    out = (torch.arange(width)[None, :] < lengths_t[:, None]).float()  # (N, L)
    if masks is None:
        return out
    assert len(masks) == len(lengths), f"{len(masks)=} {len(lengths)=}"
    for i, (m, n) in enumerate(zip(masks, lengths_t.tolist(), strict=True)):
        if m is None:
            continue
        m = torch.as_tensor(list(m), dtype=torch.float32)
        if m.numel() != n or not ((m == 0) | (m == 1)).all():
            raise ValueError(
                f"row {i}: response_mask {m.tolist()[:20]} must hold one 0 or 1 per response token ({n}), because "
                "it marks which tokens are the model's (1, trained) and which are observations (0); fix the "
                "rollout worker that wrote it or re-materialize the rollouts"
            )
        out[i, :n] *= m
    return out


def masked_fill_zero(values: Tensor, mask: Tensor) -> Tensor:
    """values where mask is 1, exactly 0 elsewhere (also where a value is inf or NaN): (N, L) each."""
    return torch.where(mask > 0, values, torch.zeros_like(values))


def pad_rollouts(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    pad_id: int,
    masks: Sequence[Sequence[int] | None] | None = None,
) -> dict[str, Tensor]:
    """Returns input_ids (N, P+L), attention_mask (N, P+L), position_ids (N, P+L),
    responses (N, L), response_mask (N, L) float, prompt_len P.

    masks: the rows' response masks (row_masks: N lists, one 0/1 per response token, or None = all ones).
    response_mask is 1 on the model's tokens only: 0 on padding and on observation tokens (masks 0), which
    stay in input_ids and attention_mask as context."""
    assert len(prompts) == len(responses), f"{len(prompts)=} {len(responses)=}"
    n = len(prompts)
    p_len = max(len(p) for p in prompts)
    r_len = max(1, max(len(r) for r in responses))
    ids = torch.full((n, p_len + r_len), pad_id, dtype=torch.long)
    attn = torch.zeros((n, p_len + r_len), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[i, p_len - len(p) : p_len] = torch.as_tensor(list(p), dtype=torch.long)
        attn[i, p_len - len(p) : p_len] = 1
        if len(r):
            ids[i, p_len : p_len + len(r)] = torch.as_tensor(list(r), dtype=torch.long)
            attn[i, p_len : p_len + len(r)] = 1
    position_ids = (attn.cumsum(dim=-1) - 1).clamp(min=0)  # (N, T)
    response_mask = loss_mask([len(r) for r in responses], r_len, masks)  # (N, L)
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "position_ids": position_ids,
        "responses": ids[:, p_len:],
        "response_mask": response_mask,
        "prompt_len": p_len,
    }


def logprob_temperature(rollout_temperature: float) -> float:
    """The temperature the trainer and the reference model divide logits by: the rollout's
    sampling temperature (verl: actor and ref log-probs use rollout.temperature), 1 for greedy
    rollouts (temperature 0)."""
    return float(rollout_temperature) if rollout_temperature > 0 else 1.0


def tempered(logits: Tensor, temperature: float) -> Tensor:
    """logits (..., V) divided by temperature; the same tensor, not a copy, at temperature 1."""
    return logits if temperature == 1.0 else logits / temperature


def response_logits(
    model, batch: dict[str, Tensor], temperature: float = 1.0, *, param_dtype: str = "float32"
) -> Tensor:
    """Float32 logits predicting each response token, divided by `temperature`: (N, L, V).

    param_dtype: the forward's compute dtype (actor.mixed_precision.param_dtype; stages.train.precision):
    'bfloat16' runs it under autocast and upcasts the logits to float32 before the temperature.
    Only the last L+1 positions go through the LM head (`logits_to_keep`): with a vocabulary of
    50k and long prompts, full-sequence float32 logits (and their gradients) were most of a
    trainer's memory."""
    l_len = batch["responses"].shape[1]
    with autocast(param_dtype, batch["input_ids"].device):
        out = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            use_cache=False,
            logits_to_keep=l_len + 1,
        )
    return tempered(at_least_float32(out.logits[:, :l_len]), temperature)  # positions P-1 .. P+L-2: (N, L, V)


def to_device(batch: dict, device: torch.device | str) -> dict:
    """The batch with every tensor on `device` (the model's: a worker's cuda:0 on GPUs); other entries as they
    are. On the CPU the tensors themselves are returned, not copies."""
    return {k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in batch.items()}


def model_device(model) -> torch.device:
    """The device of a model's parameters (the CPU for a model without any)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def select_rows(batch: dict, idx: Tensor) -> dict:
    """The rows idx of every tensor of a padded batch (a micro-batch); other entries (prompt_len) as they are."""
    return {k: (v[idx] if isinstance(v, Tensor) else v) for k, v in batch.items()}


def ragged_to_padded(lists, width: int) -> Tensor:
    """(N, width) float32 from N ragged lists (zeros after each list's end)."""
    out = torch.zeros(len(lists), width)
    for i, values in enumerate(lists):
        values = list(values)
        out[i, : len(values)] = torch.as_tensor(values, dtype=torch.float32)
    return out


def token_advantages(rows: dict, response_mask: Tensor) -> Tensor:
    """(N, L) advantages: rows["token_advantages"] (ragged lists) when present, else the (N,)
    rows["advantages"] copied onto every response token; exactly 0 where response_mask is 0."""
    if rows.get("token_advantages") is None:
        return masked_fill_zero(rows["advantages"].float()[:, None].expand_as(response_mask), response_mask)
    return masked_fill_zero(ragged_to_padded(rows["token_advantages"], response_mask.shape[1]), response_mask)


def actor_batch(rows: dict, pad_id: int, *, use_kl_loss: bool, rollout_logprobs: bool = False) -> dict[str, Tensor]:
    """The padded batch of a policy update (both backends): pad_rollouts' tensors plus advantages (N, L),
    for actor.use_kl_loss the reference policy's ref_logprobs (N, L), and when the rows carry them the
    old_logprobs stage's old_logprobs (N, L), the PPO ratio's denominator. Every per-token input is 0 where
    response_mask is 0 (padding, observation tokens), so those tokens cannot reach the loss or its gradient.

    rows: prompt_token_ids, response_token_ids (N ragged lists each), advantages (N,) or token_advantages
    (N ragged lists), ref_logprobs (N ragged lists, needed by the KL loss), optional old_logprobs (N ragged
    lists; without them the torch update recomputes them), optional response_mask (N ragged 0/1 lists or
    None: 1 = the model's token; missing = all ones); with rollout_logprobs=True (algorithm.rollout_correction
    on) the engine's rollout_logprobs (N ragged lists), padded to batch["rollout_logprobs"] (N, L)."""
    batch = pad_rollouts(
        rows["prompt_token_ids"], rows["response_token_ids"], pad_id, row_masks(rows.get("response_mask"))
    )
    mask, width = batch["response_mask"], batch["responses"].shape[1]
    batch["advantages"] = token_advantages(rows, mask)  # (N, L)
    if rows.get("old_logprobs") is not None:
        batch["old_logprobs"] = masked_fill_zero(ragged_to_padded(rows["old_logprobs"], width), mask)  # (N, L)
    if use_kl_loss:
        if "ref_logprobs" not in rows:
            raise ValueError(
                "actor.use_kl_loss=True needs ref_logprobs in the batch; enable the "
                "reference log-prob stage or set actor.use_kl_loss=False."
            )
        batch["ref_logprobs"] = masked_fill_zero(ragged_to_padded(rows["ref_logprobs"], width), mask)  # (N, L)
    if rollout_logprobs:  # algorithm.rollout_correction: the engine's log-probs, (N, L)
        batch["rollout_logprobs"] = masked_fill_zero(engine_logprobs(rows, width), mask)
    return batch


def engine_logprobs(rows: dict, width: int) -> Tensor:
    """(N, width) the rollout engine's rollout_logprobs of rows (N ragged lists, one per response token), for
    algorithm.rollout_correction; a what/why/fix error when they are missing or of the wrong length."""
    lists = rows.get("rollout_logprobs")
    lengths = [len(r) for r in rows["response_token_ids"]]
    bad = [] if lists is None else [i for i, (x, n) in enumerate(zip(lists, lengths, strict=True)) if len(x) != n]
    if lists is None or bad:
        raise ValueError(
            "algorithm.rollout_correction needs the engine's rollout_logprobs of every response token in the "
            f"advantages table ({'none' if lists is None else f'rows {bad[:10]} have another length'}), because "
            "the correction compares them with the trainer's; re-materialize advantages of this iteration, or set "
            "algorithm.rollout_correction.rollout_is and rollout_rs to null"
        )
    return ragged_to_padded(lists, width)


def stored_old_logprobs(part: pd.DataFrame) -> list[list[float]] | None:
    """The rows' old_logprobs (the old_logprobs stage's, one per response token), or None when the table has
    none (written by an older rlake or by a test: every list empty or null), so the update recomputes them."""
    if "old_logprobs" not in part.columns:
        return None
    old = [[] if x is None else list(x) for x in part["old_logprobs"]]
    lengths = [len(r) for r in part["response_token_ids"]]
    if not any(old):
        return None
    bad = [int(i) for i, o, n in zip(part["rollout_id"], old, lengths, strict=True) if len(o) != n][:10]
    if bad:
        raise ValueError(
            f"rollouts {bad} of the advantages table have old_logprobs of another length than their response: "
            "re-materialize old_logprobs and advantages of this iteration"
        )
    return old
