"""Versioned policy checkpoints in HF format: <root>/<run_id>/policy_v<version>.

Version v is the policy that generates iteration v's rollouts; iteration i's update writes v=i+1.
Also the one atomic write of rlake (`atomic_dir`, `atomic_write_text`) and the optimizer state stored
beside a checkpoint (`save_optimizer_state`, `load_optimizer_state`; stages.train.optim restores it).
`ModelStore.policy_fingerprint` / `fingerprint_checkpoint` (stages.models.fingerprint): a version's weights
fingerprint, compared with the rollout rows' engine_weights_fingerprint.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from stages.models.fingerprint import fingerprint_checkpoint

_VERSION_RE = re.compile(r"^policy_v(\d+)$")


class ModelStore:
    def __init__(self, root: str | Path, run_id: str) -> None:
        self.dir = Path(root) / run_id

    def policy_dir(self, version: int) -> Path:
        return self.dir / f"policy_v{version}"

    def critic_dir(self, version: int) -> Path:
        """Critic (PPO with GAE) version `version`: it scores iteration `version`'s rollouts (stages.train.critic)."""
        return self.dir / f"critic_v{version}"

    def policy_fingerprint(self, version: int, *, dtype: str | None = None) -> str:
        """fingerprint_checkpoint of policy version `version` (a few KiB read): what a rollout row's
        engine_weights_fingerprint equals when that version's weights reached the engine. dtype: the
        engine's weight dtype when it holds fewer bits than the checkpoint (stages/models/fingerprint.py)."""
        return fingerprint_checkpoint(self.require(version, needed_by="the weights-fingerprint check"), dtype=dtype)

    def versions(self) -> list[int]:
        if not self.dir.is_dir():
            return []
        found = (_VERSION_RE.match(p.name) for p in self.dir.iterdir() if (p / "config.json").is_file())
        return sorted(int(m.group(1)) for m in found if m)

    def require(self, version: int, *, needed_by: str) -> Path:
        path = self.policy_dir(version)
        if not (path / "config.json").is_file():
            have = self.versions()
            raise FileNotFoundError(
                f"{needed_by} needs policy version {version} at {path}, which does not exist (have {have}). "
                f"Version {version} is written by iteration {version - 1}'s policy_checkpoint "
                "(version 0 by initial_policy): materialize that first."
            )
        return path

    def remove_partial(self) -> list[str]:
        """Delete leftovers of a writer killed mid-write (policy_vN.tmp); complete versions are untouched."""
        if not self.dir.is_dir():
            return []
        removed = []
        for p in sorted(self.dir.glob("policy_v*.tmp")):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            removed.append(p.name)
        return removed

    def prune(self, keep_every: int, latest: int) -> list[int]:
        """Delete versions not multiple of keep_every, except 0 and the newest two; returns deleted."""
        removed = []
        for v in self.versions():
            if v in (0, latest, latest - 1) or (keep_every > 0 and v % keep_every == 0):
                continue
            shutil.rmtree(self.policy_dir(v))
            removed.append(v)
        return removed


OPTIMIZER_FILE = "optimizer.pt"
"""Optimizer + LR-scheduler state beside an HF checkpoint (policy or critic), HF parameter order."""
CHECKPOINT_ID = "checkpoint_id.txt"
"""A unique id per written checkpoint: workers holding weights resident compare it to skip a reload."""


@contextmanager
def atomic_dir(out_dir: str | Path) -> Iterator[Path]:
    """The one atomic write of rlake: yields an empty `<out>.tmp` directory to fill; on success it
    replaces `out` (a retried attempt replaces its own earlier output), on error it is removed. A
    reader sees the directory complete or absent, never half-written; a writer killed mid-way leaves
    only `<out>.tmp`, which ModelStore.remove_partial deletes."""
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


def checkpoint_identity(model_dir: str | Path) -> tuple[str, str, str]:
    """(resolved dir, checkpoint id or the weight files' mtimes, config.json text): what a rollout engine
    holds. Equal identities: nothing to load; only the config equal: the weights can be loaded in place."""
    path = Path(model_dir).resolve()
    config = (path / "config.json").read_text()
    ident = checkpoint_id(path) or ":".join(
        f"{f.name}@{f.stat().st_mtime_ns}" for f in sorted(path.glob("*.safetensors"))
    )
    return str(path), ident, config


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
