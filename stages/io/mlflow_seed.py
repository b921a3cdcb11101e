"""A new local MLflow store (sqlite) copied from a migrated empty one, instead of migrating it at every run.

MLflow creates a sqlite store by running its whole alembic history (~60 migrations): 1.5 s of CPU at every new
`rlake train` output directory, every test run, every bench run. A copy of an empty store at the same schema
head is the same database; it costs 0.03 s. The empty store is made once per machine and MLflow schema
(`~/.cache/rlake/mlflow/<head revision>.db`, or under $RLAKE_MLFLOW_TEMPLATE_DIR) by MLflow itself.

What differs from a store MLflow creates is reset after the copy: the `Default` experiment's artifact location
(`<cwd>/mlruns/0`, from the process that creates the store) and its creation time. Anything unexpected (an
MLflow whose private schema API moved, a read-only cache, a template at another head) falls back to letting
MLflow create the store itself: seeding only ever saves time.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path

SQLITE_PREFIX = "sqlite:///"
TEMPLATE_DIR_ENV = "RLAKE_MLFLOW_TEMPLATE_DIR"
DEFAULT_TEMPLATE_DIR = Path.home() / ".cache" / "rlake" / "mlflow"


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a `sqlite:///<path>` tracking URI (None for any other store)."""
    if not tracking_uri.startswith(SQLITE_PREFIX):
        return None
    path = tracking_uri[len(SQLITE_PREFIX) :].split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


def _head_revision() -> str:
    """MLflow's schema head (its alembic scripts; no database is opened)."""
    from mlflow.store.db.utils import _get_latest_schema_revision  # noqa: PLC0415 - imports alembic

    return _get_latest_schema_revision()


def _template_dir() -> Path:
    return Path(os.environ.get(TEMPLATE_DIR_ENV) or DEFAULT_TEMPLATE_DIR).expanduser()


def _revision_of(db: Path) -> str | None:
    with sqlite3.connect(db) as con:
        row = con.execute("SELECT version_num FROM alembic_version").fetchone()
    return row[0] if row else None


def template(head: str) -> Path:
    """The migrated empty store at schema `head`, made by MLflow the first time (atomically: a process that races
    another keeps the first complete one)."""
    from mlflow.tracking import MlflowClient  # noqa: PLC0415 - heavy import, only when a template is made

    folder = _template_dir()
    out = folder / f"{head}.db"
    if out.exists():
        return out
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        db = Path(tmp) / "store.db"
        MlflowClient(tracking_uri=f"{SQLITE_PREFIX}{db}").search_experiments()  # runs the migrations
        if _revision_of(db) != head:
            raise RuntimeError(f"MLflow migrated {db} to {_revision_of(db)}, not to its head {head}")
        os.replace(db, out)
    return out


def seed_sqlite_store(tracking_uri: str) -> bool:
    """Create the sqlite store of `tracking_uri` as a copy of the migrated empty store, if it does not exist yet.
    True when it copied one; False when there was nothing to do or it left the creation to MLflow."""
    db = sqlite_path(tracking_uri)
    if db is None or db.exists():
        return False
    try:
        source = template(_head_revision())
        db.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=db.parent, prefix=f".{db.name}.", suffix=".seed")
        os.close(fd)
        try:
            shutil.copyfile(source, tmp)
            now = int(time.time() * 1000)
            with sqlite3.connect(tmp) as con:  # what MLflow would have written for a store created here
                con.execute(
                    "UPDATE experiments SET artifact_location = ?, creation_time = ?, last_update_time = ? "
                    "WHERE experiment_id = 0",
                    (str(Path.cwd() / "mlruns" / "0"), now, now),
                )
            con.close()
            os.link(tmp, db)  # never over a store another process created meanwhile (FileExistsError)
        finally:
            os.unlink(tmp)
    except Exception:  # seeding only saves time: MLflow opens or creates the store as it always did
        return False
    return True
