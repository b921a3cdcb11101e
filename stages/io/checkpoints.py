"""Checkpoints as committed objects in storage, fetched by id into a node-local cache (DESIGN.md "Cluster mode").

Layout under `<storage root>/checkpoints/<run_id>/` (stages.io.uris.checkpoints_root), `kind` policy | critic:
- s3:// (any remote root): files under `<kind>_v<N>/<attempt_id>/`, then `<kind>_v<N>/MANIFEST.json` written LAST
  with a conditional put (create-only: `If-None-Match: *`). A writer killed before its manifest leaves objects no
  reader sees (`versions()` lists manifests only); a second commit of a version is refused
  (CheckpointExistsError), so a retried or late attempt never clobbers a committed one.
- file:// (the default, storage.root null): the files stay where they always were, `<kind>_v<N>/` written whole or
  not at all (`atomic_dir`), and the same manifest is created beside them with O_EXCL: no copy, no upload.
  A `<kind>_v<N>/` with config.json and no manifest (written before manifests existed) counts as committed.

Version v of the policy generates iteration v's rollouts; iteration i's update writes v=i+1 (critic v scores
iteration v). Readers: `ModelStore.fetch(v)` is a local directory on this node (the local root's own directory, or
a download into `storage.cache_dir` keyed by the checkpoint id, renamed into place whole); `ModelStore.require(v)`
is what the driver hands a Ray worker: that directory for a local root, else a checkpoint reference string
(`checkpoint_ref`) the worker turns into its own cached copy with `resolve_model_dir`. Identity of a checkpoint
(engine sync, resident policies, lineage) is its checkpoint id, never a path or mtime.
Re-materializing a version replaces it explicitly: the asset `retract`s the committed manifest, then a new attempt
commits. One row per commit goes to the `checkpoints` Delta table (`checkpoint_row`; assets/common.py writes it).
The files inside one checkpoint directory (the atomic write, the id file, optimizer state, identities) are in
stages.io.checkpoint_files, re-exported here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from configs.schema import RunConfig
from stages.io import checkpoint_cache, objects, uris
from stages.io.checkpoint_cache import cache_name as _cache_name
from stages.io.checkpoint_files import (  # noqa: F401 - re-exported: callers import them from here
    CHECKPOINT_ID,
    OPTIMIZER_FILE,
    SAMPLE_BYTES,
    WEIGHT_SUFFIXES,
    atomic_dir,
    atomic_write_text,
    checkpoint_id,
    checkpoint_identity,
    checkpoint_row,
    load_optimizer_state,
    model_version,
    save_optimizer_state,
)
from stages.models.fingerprint import fingerprint_checkpoint

KINDS = ("policy", "critic")
MANIFEST = "MANIFEST.json"
"""Written last, create-only: its existence is the commit."""
DEFAULT_CACHE_DIR = "~/.cache/rlake/checkpoints"
_NAME_RE = re.compile(r"^(policy|critic)_v(\d+)$")


def _fingerprint(ckpt_dir: Path) -> str | None:
    """fingerprint_checkpoint of a policy being committed (None: not an HF safetensors checkpoint)."""
    try:
        return fingerprint_checkpoint(ckpt_dir)
    except (OSError, KeyError, ValueError):
        return None


class CheckpointExistsError(FileExistsError):
    """A commit of a version that is already committed (a retried or late attempt)."""


@dataclass
class Staged:
    """A checkpoint being written: fill `dir`; after the `ModelStore.writer` block, `manifest` is the commit."""

    dir: Path
    attempt_id: str
    checkpoint_id: str
    manifest: dict = field(default_factory=dict)


def _files(root: Path) -> dict[str, int]:
    return {p.relative_to(root).as_posix(): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


class ModelStore:
    """The committed checkpoints of run `run_id` under `root` (a storage URI: file:// or a path, or s3://)."""

    def __init__(
        self,
        root: str | Path,
        run_id: str,
        *,
        cache_dir: str | Path | None = None,
        options: dict[str, str] | None = None,
        keep_versions: int = 3,
    ) -> None:
        self.root = uris.normalize(root)
        self.run_id = run_id
        self.uri = uris.join(self.root, run_id)
        self.local = uris.is_local(self.root)
        self.dir = uris.local_path(self.uri) if self.local else Path("/nonexistent-remote") / run_id
        """The run's directory (local roots); remote roots have none (it names nothing on disk)."""
        self.cache_dir = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser()
        self.options = dict(options) if options else None
        self.keep_versions = keep_versions
        """Versions per run and kind this node's cache keeps (storage.cache_keep_versions; v0 always)."""

    @classmethod
    def for_config(cls, cfg: RunConfig, run_id: str | None = None) -> ModelStore:
        """The run's store from storage.root / storage.options / storage.cache_dir."""
        root = uris.checkpoints_root(cfg)
        s = cfg.storage
        kw = {"cache_dir": s.cache_dir, "options": uris.storage_options(cfg), "keep_versions": s.cache_keep_versions}
        return cls(root, run_id or cfg.run_id, **kw)

    @property
    def store(self):
        return objects.open_store(self.root, self.options)

    def _key(self, kind: str, version: int, *parts: str) -> str:
        if kind not in KINDS:
            raise ValueError(f"unknown checkpoint kind '{kind}'; valid: {list(KINDS)}")
        return "/".join([self.run_id, f"{kind}_v{int(version)}", *parts])

    def local_dir(self, kind: str, version: int) -> Path:
        """Where version `version` lives on this node's disk for a local root (a remote root: use fetch)."""
        if not self.local:
            raise ValueError(
                f"checkpoints under '{self.root}' are not on this node's disk: read one with "
                "ModelStore.fetch(version) (a cached local copy) or hand a worker ModelStore.require(version)"
            )
        return self.dir / f"{kind}_v{int(version)}"

    def policy_dir(self, version: int) -> Path:
        return self.local_dir("policy", version)

    def critic_dir(self, version: int) -> Path:
        """Critic (PPO with GAE) version `version`: it scores iteration `version`'s rollouts (stages.train.critic)."""
        return self.local_dir("critic", version)

    # -- reading ---------------------------------------------------------------------------------------------
    def manifest(self, version: int, kind: str = "policy") -> dict | None:
        """The commit of a version (None: not committed). A legacy local directory gets a synthesized one."""
        data = objects.get_bytes(self.store, self._key(kind, version, MANIFEST))
        if data is not None:
            return json.loads(data)
        if self.local and (self.local_dir(kind, version) / "config.json").is_file():
            path = self.local_dir(kind, version)
            return {"kind": kind, "version": int(version), "checkpoint_id": checkpoint_id(path), "legacy": True}
        return None

    def versions(self, kind: str = "policy") -> list[int]:
        """Committed versions (a manifest; locally also a complete pre-manifest directory)."""
        found = set()
        if self.local:
            if not self.dir.is_dir():
                return []
            for p in self.dir.iterdir():
                m = _NAME_RE.match(p.name)
                if m and m.group(1) == kind and ((p / MANIFEST).is_file() or (p / "config.json").is_file()):
                    found.add(int(m.group(2)))
            return sorted(found)
        for key in objects.list_keys(self.store, self.run_id):
            parts = key.split("/")
            m = _NAME_RE.match(parts[1]) if len(parts) == 3 and parts[2] == MANIFEST else None
            if m and m.group(1) == kind:
                found.add(int(m.group(2)))
        return sorted(found)

    def _missing(self, version: int, kind: str, needed_by: str) -> FileNotFoundError:
        writer = "critic_checkpoint" if kind == "critic" else "policy_checkpoint"
        first = "created by the values asset of iteration 0" if kind == "critic" else "written by initial_policy"
        return FileNotFoundError(
            f"{needed_by} needs {kind} version {version} at {uris.join(self.uri, f'{kind}_v{version}')}, which is "
            f"not committed (have {self.versions(kind)}). Version {version} is written by iteration {version - 1}'s "
            f"{writer} (version 0 is {first}): materialize that first."
        )

    def fetch(self, version: int, kind: str = "policy", *, needed_by: str = "a reader") -> Path:
        """A local directory holding committed version `version` on this node: a local root's own directory,
        else the copy in cache_dir keyed by its checkpoint id (downloaded whole on first use)."""
        m = self.manifest(version, kind)
        if m is None:
            raise self._missing(version, kind, needed_by)
        if self.local:
            return self.local_dir(kind, version)
        return self._cached(m)

    def _cached(self, m: dict) -> Path:
        dest = self.cache_dir / _cache_name(m["checkpoint_id"])
        if not (dest / "config.json").is_file():
            objects.download(self.store, {n: f"{m['prefix']}/{n}" for n in m["files"]}, dest)
            self._cache_added(m, dest)
        return dest

    def _cache_added(self, m: dict, dest: Path) -> None:
        checkpoint_cache.record(self.cache_dir, m, dest.name)
        checkpoint_cache.prune(self.cache_dir, self.run_id, m["kind"], self.keep_versions, added=dest.name)

    def fetch_tokenizer(self, version: int, kind: str = "policy", *, needed_by: str = "a reader") -> Path:
        """A local directory holding what load_tokenizer reads of committed version `version` (config.json and
        the tokenizer files; a remote root's weights and optimizer state are not downloaded for it)."""
        m = self.manifest(version, kind)
        if m is None:
            raise self._missing(version, kind, needed_by)
        whole = None if self.local else self.cache_dir / _cache_name(m["checkpoint_id"])
        if whole is None or (whole / "config.json").is_file():
            return self.local_dir(kind, version) if whole is None else whole
        return checkpoint_cache.download_tokenizer(self.store, self.cache_dir, m)

    def require(self, version: int, *, needed_by: str, kind: str = "policy") -> Path | str:
        """What a reader anywhere in the cluster opens version `version` by: the directory for a local root, else
        a checkpoint reference (resolve_model_dir turns it into a cached copy on the worker's node)."""
        m = self.manifest(version, kind)
        if m is None:
            raise self._missing(version, kind, needed_by)
        if self.local:
            return self.local_dir(kind, version)
        return checkpoint_ref(self, m)

    def read_file(self, version: int, name: str, kind: str = "policy") -> bytes | None:
        """One small file of a committed version (e.g. trainer_state.json) without fetching the weights."""
        m = self.manifest(version, kind)
        if m is None:
            return None
        if self.local:
            path = self.local_dir(kind, version) / name
            return path.read_bytes() if path.is_file() else None
        return objects.get_bytes(self.store, f"{m['prefix']}/{name}") if name in m["files"] else None

    def policy_fingerprint(self, version: int, *, dtype: str | None = None) -> str:
        """fingerprint_checkpoint of policy version `version` (a few KiB read): what a rollout row's
        engine_weights_fingerprint equals when that version's weights reached the engine. dtype: the
        engine's weight dtype when it holds fewer bits than the checkpoint (stages/models/fingerprint.py)."""
        recorded = (self.manifest(version) or {}).get("fingerprint") if dtype is None else None
        return recorded or fingerprint_checkpoint(self.fetch(version, needed_by="the weights check"), dtype=dtype)

    # -- writing ---------------------------------------------------------------------------------------------
    def _refuse(self, version: int, kind: str, attempt_id: str) -> CheckpointExistsError:
        m = self.manifest(version, kind) or {}
        return CheckpointExistsError(
            f"cannot commit {kind} version {version} of run {self.run_id} (attempt {attempt_id}): it is already "
            f"committed as checkpoint {m.get('checkpoint_id')} by attempt {m.get('attempt_id')}, and a committed "
            "version is never overwritten (a retried or late attempt of the same update). To recompute it on "
            f"purpose, retract it first (ModelStore.retract({version}, '{kind}'): re-materializing the asset does)."
        )

    @contextmanager
    def writer(self, kind: str, version: int, *, checkpoint_id: str | None = None) -> Iterator[Staged]:
        """Yields a Staged whose empty `dir` the caller fills; on a clean exit the files are committed (uploaded
        under a new attempt id, then the manifest created last), on an error nothing is committed."""
        attempt = uuid.uuid4().hex[:12]
        ckpt_id = checkpoint_id or f"{self.run_id}/{kind}_v{version}/{attempt}"
        if self.manifest(version, kind) is not None:
            raise self._refuse(version, kind, attempt)
        if self.local:
            staging = self.dir / f"{kind}_v{version}.tmp"  # one writer per run: atomic_dir's name
        else:
            staging = self.cache_dir / ".staging" / attempt
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        staged = Staged(staging, attempt, ckpt_id)
        try:
            yield staged
            (staging / CHECKPOINT_ID).write_text(ckpt_id)
            staged.manifest = self._commit(kind, version, staged)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _commit(self, kind: str, version: int, staged: Staged) -> dict:
        files = _files(staged.dir)
        prefix = self._key(kind, version, staged.attempt_id) if not self.local else self._key(kind, version)
        manifest = {
            "run_id": self.run_id,
            "kind": kind,
            "version": int(version),
            "checkpoint_id": staged.checkpoint_id,
            "attempt_id": staged.attempt_id,
            "prefix": prefix,
            "uri": uris.join(self.root, prefix),
            "files": files,
            "bytes": int(sum(files.values())),
            "committed_at": time.time(),
            "fingerprint": _fingerprint(staged.dir) if kind == "policy" else None,  # the weights check reads this
        }
        if self.local:  # the directory replaces an uncommitted leftover, never a committed version
            out = self.local_dir(kind, version)
            if (out / MANIFEST).is_file():
                raise self._refuse(version, kind, staged.attempt_id)
            if out.exists():
                shutil.rmtree(out)
            os.replace(staged.dir, out)
        else:
            objects.put_files(self.store, {f"{prefix}/{name}": staged.dir / name for name in files})
        try:
            objects.put_bytes(
                self.store, self._key(kind, version, MANIFEST), json.dumps(manifest).encode(), create=True
            )
        except objects.AlreadyExists:
            if not self.local:
                objects.delete_prefix(self.store, prefix)  # this attempt's objects: nothing names them
            raise self._refuse(version, kind, staged.attempt_id) from None
        if not self.local:  # the writer's node keeps its copy: no download when it reads the version back
            dest = self.cache_dir / _cache_name(staged.checkpoint_id)
            if not dest.exists():
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.replace(staged.dir, dest)
                self._cache_added(manifest, dest)
        return manifest

    def retract(self, version: int, kind: str = "policy") -> dict | None:
        """Un-commit a version on purpose (re-materialization, prune): the manifest first, then its files.
        Returns the retracted manifest (None: nothing was committed). Cached copies stay valid under their id."""
        m = self.manifest(version, kind)
        if m is None:
            return None
        if self.local:
            shutil.rmtree(self.local_dir(kind, version), ignore_errors=True)
        else:
            objects.delete_prefix(self.store, self._key(kind, version))
        return m

    def remove_partial(self) -> list[str]:
        """Delete leftovers of writers killed mid-write: local `<kind>_vN.*tmp` directories; remote attempt
        prefixes that no manifest names. Committed versions are untouched."""
        removed: list[str] = []
        if self.local:
            if not self.dir.is_dir():
                return []
            for p in sorted(self.dir.glob("*_v*.tmp")):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                removed.append(p.name)
            return removed
        keys = objects.list_keys(self.store, self.run_id)
        committed = {"/".join(k.split("/")[:2]): None for k in keys if k.endswith("/" + MANIFEST)}
        for name in committed:
            committed[name] = json.loads(objects.get_bytes(self.store, f"{name}/{MANIFEST}") or b"{}").get("prefix")
        for attempt in sorted({"/".join(k.split("/")[:3]) for k in keys if len(k.split("/")) > 3}):
            if committed.get("/".join(attempt.split("/")[:2])) != attempt:
                objects.delete_prefix(self.store, attempt)
                removed.append(attempt)
        return removed

    def prune(self, keep_every: int, latest: int, kind: str = "policy") -> list[int]:
        """Retract versions not multiple of keep_every, except 0 and the newest two; returns those removed."""
        removed = []
        for v in self.versions(kind):
            if v in (0, latest, latest - 1) or (keep_every > 0 and v % keep_every == 0):
                continue
            self.retract(v, kind)
            removed.append(v)
        return removed


from stages.io.checkpoint_refs import (  # noqa: E402, F401 - re-exported; they build ModelStores of references
    REF_PREFIX,
    checkpoint_ref,
    checkpoint_target,
    ref_checkpoint_id,
    resolve_model_dir,
    writing,
)
