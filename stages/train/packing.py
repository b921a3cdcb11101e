"""Dynamic batching by tokens and sequence packing (verl's `use_dynamic_bsz` with remove-padding).

Choices:
- Micro-batches by a token budget (actor.ppo_max_token_len_per_gpu for the update,
  actor.log_prob_max_token_len_per_gpu for the log-prob passes): the fewest micro-batches whose real tokens
  (prompt + response, no padding) each fit the budget, filled longest-first into the currently lightest one
  (deterministic; verl balances with Karmarkar-Karp). The split happens inside a mini-batch and the loss of each
  micro-batch is still its share of the whole mini-batch's (stages.algos.losses.GlobalBatch), so every
  loss_agg_mode keeps its normalisation: only float summation order changes.
- Packing (verl's remove-padding): a micro-batch's sequences are concatenated into one row (1, T) without
  padding, each with its own position ids 0..len-1 and cu_seqlens. Attention stays inside each sequence:
  with flash_attention_2 (GPU) transformers runs flash-attn's varlen kernel from cu_seq_lens_q/k; any other
  implementation is switched, for the packed forward only, to `rlake_varlen` (registered here): torch's own
  flash-attn varlen kernel (torch.nn.attention.varlen) on a GPU at bf16/fp16 where the installed torch has it,
  else sdpa causally on each sequence's part (exact block-diagonal causal attention, cost sum(len^2), no (T, T)
  mask; the CPU path, and what the equality tests run).
- Only the positions that predict response tokens go through the LM head (`logits_to_keep` as indices), and
  log-probs and entropy are scattered back into the padded (n, L) layout the losses take, 0 on padding: the
  padded path's values there are masked out of every loss term, so the loss and its gradient are the same.

Shape legend: n rows of a micro-batch, P prompt len, L response len (padded), T packed tokens, K response tokens
of the micro-batch, V vocab.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from stages.algos.losses import at_least_float32, entropy_from_logits, gather_logprobs
from stages.train.precision import autocast

VARLEN = "rlake_varlen"
"""The attention implementation of packed forwards when the model's own is not flash-attn's."""
NATIVE_VARLEN = ("flash_attention_2", "flash_attention_3", "flash_attention_4")
"""Implementations that take cu_seq_lens_q/k themselves (transformers' flash-attn integration)."""


def token_budget_micro_batches(lengths: Sequence[int], max_tokens: int, min_count: int = 1) -> list[list[int]]:
    """Positions 0..n-1 of `lengths` (each row's real tokens) cut into the fewest micro-batches (at least
    min_count, at most n) of at most max_tokens tokens found by longest-first into the lightest micro-batch; each
    micro-batch's positions ascend, micro-batches ordered by their first position. A row longer than max_tokens
    is a what/why/fix ValueError."""
    lengths = [int(x) for x in lengths]
    if lengths and max(lengths) > max_tokens:
        raise ValueError(
            f"a sequence of {max(lengths)} tokens (prompt + response) exceeds the token budget {max_tokens} "
            "(actor.ppo_max_token_len_per_gpu or actor.log_prob_max_token_len_per_gpu), because a sequence is never "
            "split across micro-batches; raise the budget to at least data.max_prompt_length + "
            "data.max_response_length (verl's rule: max_token_len >= the longest sequence)"
        )
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    k = min(max(1, min_count, -(-sum(lengths) // max_tokens)), max(1, len(lengths)))
    while True:
        bins: list[list[int]] = [[] for _ in range(k)]
        loads = [0] * k
        for i in order:
            j = min(range(k), key=lambda b: (loads[b], b))
            bins[j].append(i)
            loads[j] += lengths[i]
        if max(loads) <= max_tokens:
            return sorted((sorted(b) for b in bins if b), key=lambda b: b[0])
        k += 1


def split_by_tokens(idx: Tensor, token_lengths: Tensor, max_tokens: int, min_count: int = 1) -> list[Tensor]:
    """The micro-batches (row indices of the batch) of one mini-batch `idx` under a token budget (at least
    min_count of them while idx has as many rows); token_lengths (N,) the batch's real tokens per row."""
    parts = token_budget_micro_batches(token_lengths[idx].tolist(), max_tokens, min_count)
    return [idx[torch.as_tensor(p, dtype=torch.long)] for p in parts]


def varlen_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs):
    """Causal attention inside each packed sequence: query/key/value (1, heads, T, head_dim), the sequences'
    bounds in kwargs["cu_seq_lens_q"] (S+1,). Returns ((1, T, heads, head_dim), None) as sdpa's does: torch's
    flash-attn varlen kernel on a GPU at bf16/fp16 where this torch has it, else sdpa on each sequence."""
    del attention_mask  # packed forwards have none: the bounds are cu_seq_lens_q
    if kwargs.get("sliding_window") is not None:
        raise ValueError("sequence packing does not support sliding-window attention; set actor.use_dynamic_bsz=False")
    cu = kwargs.pop("cu_seq_lens_q")
    fused = _cuda_varlen(query, key, value, cu, kwargs.get("max_length_q"), kwargs.get("scaling"))
    if fused is not None:
        return fused, None
    for name in ("cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids"):
        kwargs.pop(name, None)
    lens = cu.diff().tolist()
    # split, not slicing: its backward is one cat, where each slice's backward would fill a whole (1, heads, T, d)
    parts = zip(query.split(lens, dim=2), key.split(lens, dim=2), value.split(lens, dim=2), strict=True)
    outs = [sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kwargs)[0] for q, k, v in parts]
    return torch.cat(outs, dim=1), None


def _torch_varlen_fn():
    """(torch.nn.attention.varlen.varlen_attn, its causal keyword arguments) or None where this torch lacks it
    (its causal switch was is_causal=True in its first releases, window_size=(-1, 0) later)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: PLC0415 - a recent torch only
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = (
        {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True} if "is_causal" in params else None
    )
    return None if causal is None else (varlen_attn, causal, "enable_gqa" in params)


TORCH_VARLEN = _torch_varlen_fn()


def _cuda_varlen(query: Tensor, key: Tensor, value: Tensor, cu: Tensor, max_len, scale) -> Tensor | None:
    """(1, T, heads, head_dim) from torch's flash-attn varlen kernel, or None where it cannot run (CPU, float32,
    no such kernel in this torch). query (1, heads, T, d), key/value (1, kv_heads, T, d): transposed to (T, h, d)."""
    if TORCH_VARLEN is None or not query.is_cuda or query.dtype not in (torch.bfloat16, torch.float16):
        return None
    return flash_varlen(TORCH_VARLEN, query, key, value, cu, max_len, scale)


def flash_varlen(spec, query: Tensor, key: Tensor, value: Tensor, cu: Tensor, max_len, scale) -> Tensor:
    """_cuda_varlen's call of spec = (varlen_attn, its causal keywords, whether it takes enable_gqa)."""
    fn, causal, has_gqa = spec
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T, h, d)
    gqa = {}
    if k.shape[1] != q.shape[1]:
        if has_gqa:
            gqa = {"enable_gqa": True}
        else:  # each kv head serves the next heads / kv_heads query heads, as transformers' repeat_kv
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    cu = cu.to(device=q.device, dtype=torch.int32)
    max_len = int(max_len) if max_len is not None else int(cu.diff().max())
    out = fn(q, k, v, cu, cu, max_len, max_len, scale=scale, **causal, **gqa)  # (T, h, d)
    return out[None]


AttentionInterface.register(VARLEN, varlen_attention)


def _config(model):
    """The HF config of a model, through a DDP wrapper (.module)."""
    return getattr(model, "module", model).config


@contextmanager
def packed_attention(model) -> Iterator[None]:
    """The model's attention switched to VARLEN for the forwards inside (flash-attn kept: it is varlen)."""
    cfg = _config(model)
    old = cfg._attn_implementation
    if old in NATIVE_VARLEN:
        yield
        return
    cfg._attn_implementation = VARLEN
    try:
        yield
    finally:
        cfg._attn_implementation = old


def pack(mb: dict) -> dict[str, Tensor]:
    """One row of a padded micro-batch's real tokens (stages.train.batching.pad_rollouts' input_ids,
    attention_mask, prompt_len): input_ids and position_ids (1, T), cu_seqlens (n+1,), max_len, keep (K,)
    the positions whose logits predict response tokens, targets (K,) those tokens, and rows, cols (K,) where
    each goes in the (n, L) response layout."""
    attn = mb["attention_mask"].bool()  # (n, P+L)
    p_len = mb["prompt_len"]
    seq = attn.sum(-1)  # (n,)
    resp = attn[:, p_len:].sum(-1)  # (n,)
    assert bool((seq > resp).all()), f"every row needs a prompt token: {seq.tolist()=} {resp.tolist()=}"
    cu = torch.nn.functional.pad(seq.cumsum(0), (1, 0))  # (n+1,)
    starts = cu[:-1].repeat_interleave(seq)  # (T,) each token's sequence start
    total = int(cu[-1])
    position_ids = torch.arange(total, device=seq.device) - starts  # (T,)
    rows = torch.arange(len(seq), device=seq.device).repeat_interleave(resp)  # (K,)
    resp_starts = torch.nn.functional.pad(resp.cumsum(0), (1, 0))[:-1]
    cols = torch.arange(int(resp.sum()), device=seq.device) - resp_starts.repeat_interleave(resp)  # (K,)
    keep = (cu[:-1] + seq - resp - 1)[rows] + cols  # (K,) the position before each response token
    return {
        "input_ids": mb["input_ids"][attn][None, :],  # (1, T)
        "position_ids": position_ids[None, :],  # (1, T)
        "cu_seqlens": cu.to(torch.int32),
        "max_len": int(seq.max()),
        "keep": keep,
        "targets": mb["responses"][rows, cols],  # (K,)
        "rows": rows,
        "cols": cols,
    }


def packed_logits(model, packed: dict, temperature: float, param_dtype: str) -> Tensor:
    """Float32 logits (K, V) predicting a packed micro-batch's response tokens, divided by `temperature`."""
    cu = packed["cu_seqlens"]
    with packed_attention(model), autocast(param_dtype, packed["input_ids"].device):
        out = model(
            input_ids=packed["input_ids"],
            position_ids=packed["position_ids"],
            use_cache=False,
            logits_to_keep=packed["keep"],
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=packed["max_len"],
            max_length_k=packed["max_len"],
        )
    logits = at_least_float32(out.logits[0])  # (K, V)
    return logits if temperature == 1.0 else logits / temperature


def unpack(values: Tensor, packed: dict, shape: tuple[int, int]) -> Tensor:
    """(K,) per-response-token values into the (n, L) layout, 0 elsewhere (differentiable)."""
    out = values.new_zeros(shape)
    return out.index_put((packed["rows"], packed["cols"]), values)


def packed_response_terms(
    model, mb: dict, temperature: float, param_dtype: str = "float32", *, entropy: bool = True
) -> tuple[Tensor, Tensor | None]:
    """(logprobs, entropy) of a padded micro-batch's response tokens from one packed forward, each (n, L) as
    the padded path's (stages.train.batching.response_logits + gather_logprobs / entropy_from_logits), 0 where
    the padded batch has padding; entropy None when not asked for."""
    packed = pack(mb)
    logits = packed_logits(model, packed, temperature, param_dtype)  # (K, V)
    shape = tuple(mb["responses"].shape)
    logprobs = unpack(gather_logprobs(logits[None], packed["targets"][None])[0], packed, shape)
    ent = unpack(entropy_from_logits(logits), packed, shape) if entropy else None
    return logprobs, ent


def padding_share(attention_mask: Tensor) -> float:
    """Share of the tokens a padded forward computes that are padding: attention_mask (N, P+L) of the batch the
    micro-batches are cut from (a packed forward computes none)."""
    return 1.0 - float(attention_mask.sum()) / max(attention_mask.numel(), 1)
