"""Export a policy checkpoint as a plain Hugging Face model directory.

A checkpoint policy_v<N> holds the HF model and tokenizer plus rlake's training state
(optimizer.pt, update_metrics.json, trainer_state.json, ...). `export_policy` copies only the
files `from_pretrained` reads, then proves the copy loads with AutoModelForCausalLM/AutoTokenizer.
A checkpoint named by run and version is found under the run's storage root (`storage.root`, default
trainer.output_dir): a local root's own directory, or a remote (s3://) one fetched into the node's cache
by its checkpoint id (stages.io.checkpoints.ModelStore.fetch).
"""

from __future__ import annotations

import fnmatch
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from configs.schema import RunConfig
from stages.io import uris
from stages.io.checkpoints import ModelStore, atomic_dir

HF_FILES = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
"""Everything a plain HF model directory may hold; anything else (optimizer state, metrics) stays behind."""


def resolve_checkpoint(
    checkpoint: str | None, *, cfg: RunConfig | None = None, run_id: str | None = None, version: int | None = None
) -> Path:
    """The policy dir named by --checkpoint, or by run and version under cfg's checkpoints root
    (<storage.root>/checkpoints/<run_id>/policy_v<version>; a remote root's version is fetched into the cache)."""
    if checkpoint is not None:
        if run_id is not None or version is not None:
            raise ValueError("give either --checkpoint DIR or --run-id R --version N, not both")
        return Path(checkpoint)
    if run_id is None or version is None or cfg is None:
        raise ValueError(
            "name the checkpoint: --checkpoint <policy_vN dir>, or --run-id R --version N "
            "(with --config locating storage.root / trainer.output_dir)"
        )
    root = uris.checkpoints_root(cfg)
    if uris.is_local(root):  # the directory itself: export_policy says what is wrong with a missing one
        return uris.local_path(root) / run_id / f"policy_v{version}"
    return ModelStore.for_config(cfg, run_id).fetch(version, needed_by="rlake export")


def export_policy(checkpoint: str | Path, out_dir: str | Path, *, overwrite: bool = False) -> dict:
    """Copy the HF files of `checkpoint` to `out_dir` and verify they load; returns a summary."""
    src, out = Path(checkpoint), Path(out_dir)
    if not (src / "config.json").is_file():
        have = sorted(p.name for p in src.parent.glob("policy_v*")) if src.parent.is_dir() else []
        raise FileNotFoundError(
            f"checkpoint '{src}' is not an HF checkpoint directory (no config.json); "
            f"checkpoints next to it: {have}. Pass a policy_v<N> directory."
        )
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"export directory '{out}' exists and is not empty; pick a new --out or pass --overwrite")
    names = sorted(p.name for p in src.iterdir() if p.is_file() and any(fnmatch.fnmatch(p.name, g) for g in HF_FILES))
    if not any(n.endswith((".safetensors", ".bin")) for n in names):
        raise FileNotFoundError(f"checkpoint '{src}' has no weight files (*.safetensors / pytorch_model*.bin)")
    with atomic_dir(out) as tmp:  # the export is complete and loads, or `out` is left as it was
        for name in names:
            shutil.copy2(src / name, tmp / name)
        summary = verify_hf_dir(tmp)
    skipped = sorted(p.name for p in src.iterdir() if p.name not in names)
    return {"out": str(out), "files": names, "skipped": skipped, **summary}


def verify_hf_dir(path: str | Path) -> dict:
    """Load with plain transformers (no rlake code) and run one forward pass."""
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    ids = tok("1+2=", return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    if not torch.isfinite(logits).all():
        raise ValueError(f"exported model at '{path}' produces non-finite logits")
    return {"architecture": type(model).__name__, "num_parameters": int(sum(p.numel() for p in model.parameters()))}
