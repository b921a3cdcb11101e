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
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
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
    "put_files",
]

AlreadyExists = (AlreadyExistsError, PreconditionError)
"""What a create-only put of an existing key raises (local: AlreadyExists; S3: 412 Precondition Failed)."""

_STORES: dict[tuple[str, tuple], object] = {}
IO_THREADS = 8
"""Objects put or got at once by put_files and download: a checkpoint is ~10 files (weights shards, optimizer
state, tokenizer files), and one after the other each waits a full round trip to the store."""


def _each(fn: Callable[[object], None], items: Iterable) -> None:
    """fn(item) for every item, up to IO_THREADS at once (obstore's calls release the GIL while they wait);
    the first error is raised once all have finished."""
    items = list(items)
    if len(items) <= 1:
        for item in items:
            fn(item)
        return
    with ThreadPoolExecutor(min(IO_THREADS, len(items)), thread_name_prefix="rlake-objects") as pool:
        for future in [pool.submit(fn, item) for item in items]:
            future.result()


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


def put_files(store, files: dict[str, Path]) -> None:
    """Upload {key: local file}, IO_THREADS at a time (each multipart when large)."""
    _each(lambda item: put_file(store, *item), files.items())


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


def delete(store, keys: str | list[str]) -> None:
    """Delete the object at each key (S3: one DeleteObjects request per 1000 keys); one already gone is no error."""
    keys = [keys] if isinstance(keys, str) else keys
    try:
        obstore.delete(store, keys)
    except FileNotFoundError:  # a local store refuses the whole call for one missing file: the rest one by one
        for key in keys:
            try:
                obstore.delete(store, key)
            except FileNotFoundError:
                pass


def delete_prefix(store, prefix: str) -> int:
    """Delete every key under `prefix`; returns how many."""
    keys = list_keys(store, prefix)
    if keys:
        delete(store, keys)
    return len(keys)


def download(store, keys: dict[str, str], dest: Path) -> Path:
    """Download {relative name: key} into a fresh directory `dest`, IO_THREADS objects at a time (written beside
    it first and renamed, so `dest` is complete or absent; a concurrent download of the same dest keeps the
    first)."""
    dest = Path(dest)
    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp")

    def fetch(item: tuple[str, str]) -> None:
        target = tmp / item[0]
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as fh:
            for chunk in obstore.get(store, item[1]):
                fh.write(chunk)

    tmp.mkdir(parents=True)
    try:
        _each(fetch, keys.items())
        try:
            os.rename(tmp, dest)
        except OSError:
            if not dest.is_dir():  # not "another download won": a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
