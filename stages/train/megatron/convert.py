"""HF Llama / Qwen2 state dict <-> Megatron-Core GPTModel state dicts, one per (TP rank, PP rank).

Layouts (megatron-core local spec):
- linear_qkv: rows grouped per query group g = 0..G-1, each group [q heads of g | k_g | v_g]
  (q_per_group * D + 2 * D rows); TP ranks hold contiguous groups. Qwen2's q/k/v biases follow
  the same layout.
- linear_fc1: [gate; up] per TP rank, i.e. rank r holds cat(gate[r], up[r]) (SwiGLU).
- column-parallel (split rows over TP): word embeddings / output layer (vocab padded to a
  multiple of TP with zero rows), linear_qkv, linear_fc1. Row-parallel (split columns):
  linear_proj, linear_fc2. Norm weights are replicated on every TP rank.
- PP: stage p holds global layers [p * L/PP, (p+1) * L/PP) renumbered from 0; the embedding is on
  the first stage, final norm and output layer on the last. Tied embeddings with PP > 1 keep a
  copy of the embedding as output_layer.weight on the last stage (megatron's convention).
The same functions convert any per-parameter tensor of the same shape (e.g. AdamW moments).
"""

from __future__ import annotations

import torch
from torch import Tensor

from stages.train.megatron.model import HFArch

_COLUMN = ("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight")
_ROW = ("linear_proj.weight", "linear_fc2.weight")


def tp_partition_dim(mname: str) -> int | None:
    """The dim a Megatron parameter is split along over TP ranks; None when replicated."""
    if mname.endswith(_COLUMN):
        return 0
    if mname.endswith(_ROW):
        return 1
    return None


def stage_layers(arch: HFArch, pp_rank: int, pp: int) -> range:
    """Global layer indices held by pipeline stage pp_rank."""
    per = arch.num_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def _interleave_qkv(q: Tensor, k: Tensor, v: Tensor, arch: HFArch) -> Tensor:
    g, d = arch.num_kv_heads, arch.head_dim
    rest = q.shape[1:]
    q = q.reshape(g, arch.num_heads // g * d, *rest)  # (G, q_per_group * D, ...)
    k = k.reshape(g, d, *rest)
    v = v.reshape(g, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)  # (G * (q_per_group + 2) * D, ...)


def _split_qkv(qkv: Tensor, arch: HFArch) -> tuple[Tensor, Tensor, Tensor]:
    g, d = arch.num_kv_heads, arch.head_dim
    qpg = arch.num_heads // g
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, (qpg + 2) * d, *rest)  # (G, (q_per_group + 2) * D, ...)
    q, k, v = torch.split(grouped, [qpg * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _pad_vocab(w: Tensor, arch: HFArch, tp: int) -> Tensor:
    extra = arch.padded_vocab(tp) - w.shape[0]
    return torch.cat([w, w.new_zeros(extra, *w.shape[1:])]) if extra else w


def _full_megatron(
    hf: dict[str, Tensor], arch: HFArch, tp: int, layers: range, first: bool, last: bool
) -> dict[str, Tensor]:
    """Unsharded Megatron tensors of one stage (fc1 kept as (gate, up) for per-rank stacking)."""
    out: dict[str, Tensor | tuple[Tensor, Tensor]] = {}
    emb = _pad_vocab(hf["model.embed_tokens.weight"], arch, tp)
    if first:
        out["embedding.word_embeddings.weight"] = emb
    for local, i in enumerate(layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{local}."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = _interleave_qkv(
            hf[h + "self_attn.q_proj.weight"],
            hf[h + "self_attn.k_proj.weight"],
            hf[h + "self_attn.v_proj.weight"],
            arch,
        )
        if arch.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = _interleave_qkv(
                hf[h + "self_attn.q_proj.bias"], hf[h + "self_attn.k_proj.bias"], hf[h + "self_attn.v_proj.bias"], arch
            )
        out[m + "self_attention.linear_proj.weight"] = hf[h + "self_attn.o_proj.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = (hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"])
        out[m + "mlp.linear_fc2.weight"] = hf[h + "mlp.down_proj.weight"]
    if last:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        if not arch.tied:
            out["output_layer.weight"] = _pad_vocab(hf["lm_head.weight"], arch, tp)
        elif not first:  # tied across stages: the last stage keeps its own copy
            out["output_layer.weight"] = emb
    return out  # type: ignore[return-value]


def hf_to_megatron(
    hf: dict[str, Tensor], arch: HFArch, *, tp: int, pp: int, tp_rank: int, pp_rank: int
) -> dict[str, Tensor]:
    """The Megatron state dict of rank (tp_rank, pp_rank) from a full HF state dict."""
    full = _full_megatron(hf, arch, tp, stage_layers(arch, pp_rank, pp), pp_rank == 0, pp_rank == pp - 1)
    out = {}
    for name, t in full.items():
        if isinstance(t, tuple):  # fc1: this rank's gate rows, then its up rows
            gate, up = (x.chunk(tp, dim=0)[tp_rank] for x in t)
            out[name] = torch.cat([gate, up]).clone()
            continue
        dim = tp_partition_dim(name)
        out[name] = (t if dim is None else t.chunk(tp, dim=dim)[tp_rank]).clone()
    return out


def _unshard(name: str, parts: list[Tensor]) -> Tensor | tuple[Tensor, Tensor]:
    if name.endswith("linear_fc1.weight"):
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])
    dim = tp_partition_dim(name)
    return parts[0] if dim is None else torch.cat(parts, dim=dim)


def megatron_to_hf(
    shards: dict[tuple[int, int], dict[str, Tensor]], arch: HFArch, *, tp: int, pp: int
) -> dict[str, Tensor]:
    """A full HF state dict from every rank's Megatron state dict, keyed (tp_rank, pp_rank).

    For tied embeddings the result has lm_head.weight equal to model.embed_tokens.weight,
    as `PreTrainedModel.state_dict()` does.
    """
    hf: dict[str, Tensor] = {}
    v = arch.vocab_size
    for p in range(pp):
        names = shards[(0, p)].keys()
        full = {n: _unshard(n, [shards[(r, p)][n] for r in range(tp)]) for n in names}
        for local, i in enumerate(stage_layers(arch, p, pp)):
            h, m = f"model.layers.{i}.", f"decoder.layers.{local}."
            hf[h + "input_layernorm.weight"] = full[m + "input_layernorm.weight"]
            q, k, vv = _split_qkv(full[m + "self_attention.linear_qkv.weight"], arch)
            hf[h + "self_attn.q_proj.weight"], hf[h + "self_attn.k_proj.weight"], hf[h + "self_attn.v_proj.weight"] = (
                q,
                k,
                vv,
            )
            if arch.qkv_bias:
                q, k, vv = _split_qkv(full[m + "self_attention.linear_qkv.bias"], arch)
                hf[h + "self_attn.q_proj.bias"], hf[h + "self_attn.k_proj.bias"], hf[h + "self_attn.v_proj.bias"] = (
                    q,
                    k,
                    vv,
                )
            hf[h + "self_attn.o_proj.weight"] = full[m + "self_attention.linear_proj.weight"]
            hf[h + "post_attention_layernorm.weight"] = full[m + "pre_mlp_layernorm.weight"]
            hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"] = full[m + "mlp.linear_fc1.weight"]
            hf[h + "mlp.down_proj.weight"] = full[m + "mlp.linear_fc2.weight"]
        if p == 0:
            hf["model.embed_tokens.weight"] = full["embedding.word_embeddings.weight"][:v]
        if p == pp - 1:
            hf["model.norm.weight"] = full["decoder.final_layernorm.weight"]
            if not arch.tied:
                hf["lm_head.weight"] = full["output_layer.weight"][:v]
    if arch.tied:
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    return {k: t.contiguous() for k, t in hf.items()}
