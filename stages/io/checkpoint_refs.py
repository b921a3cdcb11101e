"""Checkpoint references: the strings that cross to a Ray worker where a local path used to be (a committed
checkpoint to read, or a version to commit), and their resolution on the worker's node. Re-exported by
stages/io/checkpoints.py, whose ModelStore they build (imported when called: that module imports this one)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from stages.io.checkpoint_cache import cache_name as _cache_name
from stages.io.checkpoint_files import atomic_dir

REF_PREFIX = "rlake-checkpoint:"
"""A checkpoint reference (checkpoint_ref): what crosses to a worker instead of a path on the driver's node."""


def _store(ref: dict):
    from stages.io.checkpoints import ModelStore  # noqa: PLC0415 - it imports this module

    kw = {"cache_dir": ref["cache_dir"], "options": ref["options"], "keep_versions": ref.get("keep", 3)}
    return ModelStore(ref["root"], ref["run_id"], **kw)


def checkpoint_ref(store, manifest: dict) -> str:
    """A string naming one committed checkpoint anywhere in the cluster (root, run, kind, version, id, and the
    non-secret storage options and cache dir), handed to workers where a local path used to be."""
    ref = {
        "root": store.root,
        "run_id": store.run_id,
        "kind": manifest["kind"],
        "version": manifest["version"],
        "checkpoint_id": manifest["checkpoint_id"],
        "cache_dir": str(store.cache_dir),
        "options": store.options,
        "keep": store.keep_versions,
    }
    return REF_PREFIX + json.dumps(ref, sort_keys=True)


def resolve_model_dir(model_dir: str | Path) -> Path:
    """A local directory for what a worker was handed: a local path as is, a checkpoint reference as the copy
    cached on this node under its checkpoint id (downloaded on first use)."""
    text = str(model_dir)
    if not text.startswith(REF_PREFIX):
        return Path(model_dir)
    ref = json.loads(text[len(REF_PREFIX) :])
    store = _store(ref)
    cached = store.cache_dir / _cache_name(ref["checkpoint_id"])
    if (cached / "config.json").is_file():
        return cached
    m = store.manifest(ref["version"], ref["kind"])
    if m is None or m.get("checkpoint_id") != ref["checkpoint_id"]:
        raise FileNotFoundError(
            f"{ref['kind']} version {ref['version']} of run {ref['run_id']} under {ref['root']} is no longer "
            f"checkpoint {ref['checkpoint_id']} (now: {None if m is None else m.get('checkpoint_id')}): it was "
            "retracted or re-materialized after this request was made; re-run the stage that needs it"
        )
    return store._cached(m)


def checkpoint_target(store, kind: str, version: int) -> str:
    """A string naming where a worker commits `kind` version `version` (the counterpart of checkpoint_ref for a
    writer): pass it where a stage takes an output directory; `writing` commits to it."""
    ref = {"root": store.root, "run_id": store.run_id, "kind": kind, "version": int(version)}
    ref |= {"checkpoint_id": None, "cache_dir": str(store.cache_dir), "options": store.options}
    ref["keep"] = store.keep_versions
    return REF_PREFIX + json.dumps(ref, sort_keys=True)


@contextmanager
def writing(out: str | Path, *, checkpoint_id: str | None = None) -> Iterator[Path]:
    """A directory to fill with a checkpoint: for a checkpoint_target, committed to its store on a clean exit
    (ModelStore.writer); for a plain directory, written whole or not at all (atomic_dir)."""
    text = str(out)
    if not text.startswith(REF_PREFIX):
        with atomic_dir(out) as tmp:
            yield tmp
        return
    ref = json.loads(text[len(REF_PREFIX) :])
    store = _store(ref)
    with store.writer(ref["kind"], ref["version"], checkpoint_id=checkpoint_id) as staged:
        yield staged.dir


def ref_checkpoint_id(model_dir: str | Path) -> str | None:
    """The checkpoint id a reference names (None for a plain path: read it from the directory)."""
    text = str(model_dir)
    return json.loads(text[len(REF_PREFIX) :])["checkpoint_id"] if text.startswith(REF_PREFIX) else None
