"""Versioned policy checkpoints in HF format: <root>/<run_id>/policy_v<version>.

Version v is the policy that generates iteration v's rollouts; iteration i's update writes v=i+1.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

_VERSION_RE = re.compile(r"^policy_v(\d+)$")


class ModelStore:
    def __init__(self, root: str | Path, run_id: str) -> None:
        self.dir = Path(root) / run_id

    def policy_dir(self, version: int) -> Path:
        return self.dir / f"policy_v{version}"

    def critic_dir(self, version: int) -> Path:
        """Critic (PPO with GAE) version `version`: it scores iteration `version`'s rollouts (stages.train.critic)."""
        return self.dir / f"critic_v{version}"

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
                "(version 0 by initial_policy): materialize that first.")
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
