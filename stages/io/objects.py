"""Object storage for checkpoints: one obstore store per storage root, the same calls for file:// and s3://.

stages.io.checkpoints commits a checkpoint as objects under `storage.root` (DESIGN.md "Cluster mode"): the files
under a per-attempt prefix, then a manifest written last with a conditional put (`put_bytes(create=True)`:
`If-None-Match: *` on S3, O_EXCL on a local disk), so a second commit of one key fails instead of replacing it.
This module is the thin wrapper: open a store for a root URI (`open_store`), put / get / list / delete keys
relative to it. Keys are '/'-joined strings, never pathlib paths.

Credentials come only from the environment (AWS_ACCESS_KEY_ID, ...; obstore reads them as delta-rs does);
`options` are the non-secret storage.options in delta-rs spelling (AWS_ENDPOINT_URL, AWS_REGION,
AWS_ALLOW_HTTP), translated to obstore's by stages.io.uris.object_store.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import obstore
from obstore.exceptions import AlreadyExistsError, PreconditionError
from obstore.store import LocalStore

from stages.io import uris

__all__ = [
    "AlreadyExists",
    "delete_prefix",
    "download",
    "get_bytes",
    "list_keys",
    "list_prefixes",
    "open_store",
    "put_bytes",
    "put_file",
]

AlreadyExists = (AlreadyExistsError, PreconditionError)
"""What a create-only put of an existing key raises (local: AlreadyExists; S3: 412 Precondition Failed)."""

_STORES: dict[tuple[str, tuple], object] = {}


def open_store(root: str, options: dict[str, str] | None = None):
    """The obstore store whose keys are relative to `root` (file:// or plain path: a LocalStore, created if
    missing; s3://bucket/prefix: an S3Store), cached per process."""
    root = uris.normalize(root)
    cache_key = (root, tuple(sorted((options or {}).items())))
    if cache_key not in _STORES:
        if uris.is_local(root):
            _STORES[cache_key] = LocalStore(uris.local_path(root), mkdir=True)
        else:  # storage.options translated to obstore's keys in one place (uris.obstore_config)
            _STORES[cache_key] = uris.object_store(root, options)
    return _STORES[cache_key]


def put_bytes(store, key: str, data: bytes, *, create: bool = False) -> None:
    """Write `data` at `key`; create=True: only if the key does not exist (raises one of AlreadyExists)."""
    obstore.put(store, key, data, mode="create" if create else "overwrite")


def put_file(store, key: str, path: Path) -> None:
    """Upload a local file (multipart for large ones, obstore's default)."""
    obstore.put(store, key, Path(path))


def get_bytes(store, key: str) -> bytes | None:
    """The object's bytes, None when it does not exist."""
    try:
        return bytes(obstore.get(store, key).bytes())
    except FileNotFoundError:
        return None


def list_prefixes(store, prefix: str) -> list[str]:
    """The names directly under `prefix` ('run/' -> ['policy_v0', ...]), objects and sub-prefixes."""
    prefix = prefix.strip("/")
    try:
        found = obstore.list_with_delimiter(store, prefix or None)
    except FileNotFoundError:
        return []
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in found["common_prefixes"]]
    return sorted(set(names + [o["path"].rsplit("/", 1)[-1] for o in found["objects"]]))


def list_keys(store, prefix: str) -> list[str]:
    """Every key under `prefix`, recursively."""
    try:
        return sorted(o["path"] for batch in obstore.list(store, prefix.strip("/") + "/") for o in batch)
    except FileNotFoundError:
        return []


def delete(store, key: str) -> None:
    """Delete the object at `key` (one already gone is no error)."""
    try:
        obstore.delete(store, key)
    except FileNotFoundError:
        pass


def delete_prefix(store, prefix: str) -> int:
    """Delete every key under `prefix`; returns how many."""
    keys = list_keys(store, prefix)
    for key in keys:
        obstore.delete(store, key)
    return len(keys)


def download(store, keys: dict[str, str], dest: Path) -> Path:
    """Download {relative name: key} into a fresh directory `dest` (written beside it first and renamed, so
    `dest` is complete or absent; a concurrent download of the same dest keeps the first)."""
    dest = Path(dest)
    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.mkdir(parents=True)
    try:
        for name, key in keys.items():
            target = tmp / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as fh:
                for chunk in obstore.get(store, key):
                    fh.write(chunk)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not dest.is_dir():  # not "another download won": a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
