"""The files inside one checkpoint directory: rlake's one atomic directory write (`atomic_dir`,
`atomic_write_text`), the checkpoint id written with it, the optimizer state stored beside an HF checkpoint,
and the identities lineage and engines compare (`checkpoint_identity`, `model_version`), and the `checkpoints`
table row of a commit (`checkpoint_row`).
stages.io.checkpoints (commit to storage, fetch by id) builds on these and re-exports them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

OPTIMIZER_FILE = "optimizer.pt"
"""Optimizer + LR-scheduler state beside an HF checkpoint (policy or critic), HF parameter order."""
CHECKPOINT_ID = "checkpoint_id.txt"
"""A unique id per written checkpoint: workers holding weights resident compare it to skip a reload."""


@contextmanager
def atomic_dir(out_dir: str | Path) -> Iterator[Path]:
    """The one atomic write of rlake: yields an empty `<out>.tmp` directory to fill; on success it
    replaces `out` (a retried attempt replaces its own earlier output), on error it is removed. A
    reader sees the directory complete or absent, never half-written; a writer killed mid-way leaves
    only `<out>.tmp`, which ModelStore.remove_partial deletes. Checkpoints commit through ModelStore.writer
    instead; this is for directories outside a run's store (an export, a converted model, a test)."""
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def atomic_write_text(path: str | Path, text: str) -> Path:
    """A single file written whole or not at all (tmp file + os.replace)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def checkpoint_id(ckpt_dir: str | Path) -> str | None:
    """The id written with a checkpoint (None for checkpoints written without one, e.g. version 0)."""
    path = Path(ckpt_dir) / CHECKPOINT_ID
    return path.read_text().strip() if path.is_file() else None


def save_optimizer_state(ckpt_dir: str | Path, optimizer_state: dict, scheduler_state: dict) -> None:
    torch.save({"optimizer": optimizer_state, "scheduler": scheduler_state}, Path(ckpt_dir) / OPTIMIZER_FILE)


def load_optimizer_state(ckpt_dir: str | Path) -> dict | None:
    """{"optimizer", "scheduler"} state dicts stored beside a checkpoint, None when it has none (version 0); the
    tensors on the CPU (a GPU run's state loads anywhere; Optimizer.load_state_dict moves it to the params)."""
    path = Path(ckpt_dir) / OPTIMIZER_FILE
    return torch.load(path, weights_only=False, map_location="cpu") if path.is_file() else None


def checkpoint_identity(model_dir: str | Path) -> tuple[str, str]:
    """(identity, config.json text) of what a rollout engine or trainer rank holds: the checkpoint id (committed
    checkpoints all have one, wherever they are cached), else for a directory written without one its resolved
    path and weight files' mtimes. Equal identities: nothing to load; only the config equal: the weights can be
    loaded in place."""
    path = Path(model_dir).resolve()
    config = (path / "config.json").read_text()
    ident = checkpoint_id(path) or str(path) + "@" + ":".join(
        f"{f.name}@{f.stat().st_mtime_ns}" for f in sorted(path.glob("*.safetensors"))
    )
    return ident, config


WEIGHT_SUFFIXES = (".safetensors", ".bin")
SAMPLE_BYTES = 1 << 20
"""model_version without a checkpoint id hashes this much of each weight file's start and end: the tensors there
(safetensors orders same-dtype tensors by name, so a sequence classifier's `score` head sits near the end)
differ between two trainings of one architecture, whose config.json and file sizes are the same."""


def model_version(path: str | Path) -> str:
    """A model directory's identity in lineage columns (rm_version, judge_model): its checkpoint id, else a
    digest of config.json and of each weight file's name, size and first and last SAMPLE_BYTES (read in
    milliseconds whatever the model's size)."""
    p = Path(path)
    ident = checkpoint_id(p)
    if ident is not None:
        return ident
    h = hashlib.sha256((p / "config.json").read_bytes())
    for f in sorted(x for x in p.iterdir() if x.suffix in WEIGHT_SUFFIXES):
        size = f.stat().st_size
        h.update(f"\n{f.name}:{size}\n".encode())
        with f.open("rb") as fh:
            h.update(fh.read(SAMPLE_BYTES))
            fh.seek(max(size - SAMPLE_BYTES, 0))
            h.update(fh.read(SAMPLE_BYTES))
    return "sha256:" + h.hexdigest()[:16]


def checkpoint_row(manifest: dict, metrics: dict | None = None) -> dict:
    """The `checkpoints` table row of one commit (the table's run_id / iteration are added by the writer)."""
    return {
        "kind": manifest["kind"],
        "version": int(manifest["version"]),
        "checkpoint_id": manifest.get("checkpoint_id") or "",
        "attempt_id": manifest.get("attempt_id"),
        "uri": manifest.get("uri"),
        "files": sorted(manifest.get("files") or []),
        "bytes": int(manifest.get("bytes") or 0),
        "metrics": json.dumps(metrics or {}, sort_keys=True),
    }
