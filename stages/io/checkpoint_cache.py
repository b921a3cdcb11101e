"""A node's cache of committed checkpoints (`storage.cache_dir`): whole copies keyed by checkpoint id, a
tokenizer-only copy for the driver, and pruning to the newest versions of each run.

- `cache_name(id)`: the directory of checkpoint `id` in the cache (readable prefix + digest: ids may hold '/').
- Every copy stages/io/checkpoints.py puts in the cache is recorded in `<cache_dir>/.index/<name>.json` (run, kind,
  version, checkpoint id), so `prune` knows which versions a directory holds without reading it.
- `prune(cache_dir, run_id, kind, keep)`: after each new copy, the run's copies of that kind other than the newest
  `keep` versions and version 0 (the reference policy, read every iteration) are renamed away, then deleted: a
  reader that already opened their files keeps reading them; a later reader downloads the version again.
- `TOKENIZER_FILES`: what load_tokenizer reads (config.json and the tokenizer's files): the driver fetches those
  alone (`ModelStore.fetch_tokenizer`), never the weights and optimizer state.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import uuid
from pathlib import Path

from stages.io import objects

INDEX = ".index"
TOKENIZER_FILES = re.compile(
    r"^(config\.json|tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\.(json|txt)|merges\.txt"
    r"|spiece\.model|chat_template\.(jinja|json))$"
)
"""Files of a checkpoint that load_tokenizer (stages/models/policy.py) reads: no weights, no optimizer state."""


def cache_name(ckpt_id: str) -> str:
    """A file-system-safe directory name for a checkpoint id."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", ckpt_id)[-80:]
    return f"{safe}-{hashlib.sha256(ckpt_id.encode()).hexdigest()[:10]}"


def record(cache_dir: Path, manifest: dict, name: str) -> None:
    """Note which run, kind and version the cache directory `name` holds (for prune)."""
    index = Path(cache_dir) / INDEX
    index.mkdir(parents=True, exist_ok=True)
    keys = ("run_id", "kind", "version", "checkpoint_id")
    (index / f"{name}.json").write_text(json.dumps({k: manifest.get(k) for k in keys} | {"dir": name}))


def download_tokenizer(store, cache_dir: Path, manifest: dict) -> Path:
    """The tokenizer files of committed checkpoint `manifest` in the cache (downloaded once, kept whole)."""
    dest = Path(cache_dir) / (cache_name(manifest["checkpoint_id"]) + ".tokenizer")
    if not (dest / "config.json").is_file():
        names = [n for n in manifest["files"] if TOKENIZER_FILES.match(n)]
        objects.download(store, {n: f"{manifest['prefix']}/{n}" for n in names}, dest)
        record(cache_dir, manifest, dest.name)
    return dest


def prune(cache_dir: Path, run_id: str, kind: str, keep: int, *, added: str = "") -> list[str]:
    """Remove the run's cached copies of `kind` outside the newest `keep` versions, version 0 and the copy just
    `added` (a reader is about to open it; keep <= 0: none removed); returns the directory names removed."""
    index = Path(cache_dir) / INDEX
    if keep <= 0 or not index.is_dir():
        return []
    entries = []
    for path in index.glob("*.json"):
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):  # another process removed or is writing it
            continue
        if entry.get("run_id") == run_id and entry.get("kind") == kind:
            entries.append((int(entry["version"]), entry["dir"], path))
    kept = set(sorted({v for v, _, _ in entries})[-keep:]) | {0}
    removed = []
    for version, name, path in entries:
        if version in kept or name == added:
            continue
        victim = Path(cache_dir) / name
        doomed = victim.with_name(f".{name}.pruned-{uuid.uuid4().hex[:8]}")
        try:
            victim.rename(doomed)
        except OSError:  # gone already
            pass
        shutil.rmtree(doomed, ignore_errors=True)
        path.unlink(missing_ok=True)
        removed.append(name)
    return sorted(removed)
