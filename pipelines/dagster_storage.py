"""Dagster's sqlite event log with pooled connections: the storage a DAGSTER_HOME of `rlake train` selects.

Dagster's default `SqliteEventLogStorage` opens a new SQLAlchemy engine and sqlite connection for every
statement batch (NullPool), commits it with a full fsync and closes it, which checkpoints the WAL into the
database file: measured at about 3.6 ms a connection and ~285 connections per RL iteration (one per stored
event, its index-shard mirror, each partition / data-version / asset-check lookup), so 1-2 s of each iteration
went to opening and closing sqlite files (docs/benchmarks.md, issue #20).

`PooledSqliteEventLogStorage` keeps the same files (one database per run under history/runs plus the
index shard: a home written by either class is read by the other, and by `dagster dev`) and the same SQL. It
creates a new run's database as a copy of an empty one (initialised once per process) instead of creating
every table and index again, keeps one engine per shard with a small connection pool (the least recently
used beyond MAX_ENGINES are closed), opens connections with `PRAGMA synchronous=NORMAL` (SQLite's
recommended setting in WAL mode: a commit is durable against a process crash and never corrupts the
database; only a power loss may drop the last commits), and remembers which tables exist.

Live views: Dagster's webserver follows a run by watching the run's database file for changes. A pooled
connection stays open, so commits land in the write-ahead log (`<run>.db-wal`) and reach the database file at
a checkpoint; this class's `watch` (the webserver loads the same dagster.yaml) therefore watches both.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml
from dagster._config import Field, StringSource
from dagster._core.storage.event_log.sqlite.sqlite_event_log import (
    INDEX_SHARD_NAME,
    SqliteEventLogStorage,
    SqliteEventLogStorageWatchdog,
)
from dagster._core.storage.sql import create_engine
from dagster._core.storage.sqlite import SQLITE_BUSY_TIMEOUT_SECONDS
from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.pool import NullPool

MODULE = __name__
CLASS = "PooledSqliteEventLogStorage"
MAX_ENGINES = 8
"""Shards with an open engine at a time: the index shard and the runs in flight (one per iteration run)."""


def _pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


class PooledSqliteEventLogStorage(SqliteEventLogStorage):
    """SqliteEventLogStorage (same files, same SQL) with one pooled engine per shard; see the module doc."""

    def __init__(self, base_dir: str | None = None, inst_data: Any = None):
        base_dir = base_dir or os.path.join(os.environ.get("DAGSTER_HOME", "."), "history", "runs")
        self._engines: OrderedDict[str, Engine] = OrderedDict()
        self._engines_pid = os.getpid()
        self._engines_lock = threading.Lock()
        self._tables: set[str] = set()
        self._empty: bytes | None = None
        super().__init__(base_dir, inst_data=inst_data)

    @classmethod
    def config_type(cls) -> dict:
        """`base_dir` (default: DAGSTER_HOME/history/runs, where Dagster's default storage keeps them)."""
        return {"base_dir": Field(StringSource, is_required=False)}

    @classmethod
    def from_config_value(cls, inst_data, config_value) -> PooledSqliteEventLogStorage:  # ty: ignore
        return cls(inst_data=inst_data, **config_value)

    def _engine(self, shard: str) -> Engine:
        """The shard's pooled engine (a forked child starts its own: the parent's connections are not shared)."""
        with self._engines_lock:
            if self._engines_pid != os.getpid():
                for engine in self._engines.values():
                    engine.dispose(close=False)
                self._engines, self._engines_pid = OrderedDict(), os.getpid()
            engine = self._engines.get(shard)
            if engine is None:
                engine = create_engine(
                    self.conn_string_for_shard(shard), connect_args={"timeout": SQLITE_BUSY_TIMEOUT_SECONDS}
                )
                event.listen(engine, "connect", _pragmas)
                self._engines[shard] = engine
                while len(self._engines) > MAX_ENGINES:
                    self._engines.popitem(last=False)[1].dispose()
            else:
                self._engines.move_to_end(shard)
            return engine

    @contextmanager
    def _connect(self, shard: str) -> Iterator[Any]:
        with self._db_lock:
            engine = self._engine(shard)
            if shard not in self._initialized_dbs:
                if not self._copy_empty_shard(shard):
                    self._initdb(engine)
                self._initialized_dbs.add(shard)
            with engine.connect() as conn, conn.begin():
                yield conn

    def _copy_empty_shard(self, shard: str) -> bool:
        """Create a new run's database as a copy of an empty one this process initialised once (Dagster's
        `_initdb` creates every table and index and stamps the schema revision per run: 0.3 s of each run's
        creation on a loaded 2-core box). False (nothing done) for the index shard, a database that exists, or
        one another process created first (the copy is linked in only where no file is)."""
        path = self.path_for_shard(shard)
        if shard == INDEX_SHARD_NAME or os.path.exists(path):
            return False
        if self._empty is None:
            self._empty = self._empty_shard_bytes()
        tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "wb") as f:
            f.write(self._empty)
        try:
            os.link(tmp, path)  # fails where a file already is: never replaces a database another process opened
        except OSError:  # FileExistsError, or a file system without hard links: Dagster's own way then
            return False
        finally:
            os.unlink(tmp)
        return True

    def _empty_shard_bytes(self) -> bytes:
        """The bytes of a run database as Dagster's `_initdb` creates it (schema at this Dagster's revision)."""
        tmp = os.path.join(self._base_dir, f".empty-run-shard.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        engine = create_engine(f"sqlite:///{tmp}", poolclass=NullPool)
        try:
            self._initdb(engine)
        finally:
            engine.dispose()
        try:
            with open(tmp, "rb") as f:
                return f.read()
        finally:
            for leftover in (tmp, tmp + "-wal", tmp + "-shm"):
                if os.path.exists(leftover):
                    os.unlink(leftover)

    def has_table(self, table_name: str) -> bool:
        """Whether the index shard has `table_name` (a table once there stays: only found ones are remembered)."""
        if table_name in self._tables:
            return True
        with self._engine(INDEX_SHARD_NAME).connect() as conn:
            found = bool(conn.dialect.has_table(conn, table_name))
        if found:
            self._tables.add(table_name)
        return found

    def wipe(self) -> None:
        self._dispose_engines()
        super().wipe()

    def dispose(self) -> None:
        self._dispose_engines()
        super().dispose()

    def _dispose_engines(self) -> None:
        with self._engines_lock:
            for engine in self._engines.values():
                engine.dispose()
            self._engines.clear()

    def watch(self, run_id: str, cursor: str | None, callback) -> None:
        """Follow run `run_id` like Dagster does, also on its write-ahead log (see the module doc)."""
        if not self._obs:
            from watchdog.observers import Observer  # noqa: PLC0415 - only the webserver watches

            self._obs = Observer()
            self._obs.start()
        watchdog = _WalWatchdog(self, run_id, callback, cursor)
        self._watchers[run_id][callback] = (watchdog, self._obs.schedule(watchdog, self._base_dir, recursive=True))


class _WalWatchdog(SqliteEventLogStorageWatchdog):
    """Dagster's run-database watchdog, matching `<run>.db` and `<run>.db-wal`."""

    def __init__(self, storage, run_id: str, callback, cursor: str | None) -> None:
        super().__init__(storage, run_id, callback, cursor)
        self._patterns = [self._log_path, self._log_path + "-wal"]

    def on_modified(self, event) -> None:  # the parent asserts the path is the .db file
        if event.src_path in self._patterns:
            self._process_log()


def _runs_dir(home: str | Path) -> str:
    """<home>/history/runs as a YAML scalar (double-quoted: any path is valid YAML)."""
    return json.dumps(str(Path(home).resolve() / "history" / "runs"))


def instance_yaml(home: str | Path) -> str:
    """The dagster.yaml lines selecting this storage for DAGSTER_HOME `home`, its files where Dagster's default
    keeps them (<home>/history/runs, written out: an instance opened from the directory, e.g.
    `DagsterInstance.from_config(home)`, finds them without DAGSTER_HOME); the run and schedule storages stay
    Dagster's sqlite defaults."""
    return f"event_log_storage:\n  module: {MODULE}\n  class: {CLASS}\n  config:\n    base_dir: {_runs_dir(home)}\n"


def relocate(text: str, home: str | Path) -> str:
    """`text` (a dagster.yaml) with this storage's base_dir pointed at `home` when instance_yaml wrote it for
    another directory (an output directory copied or moved): else the copy would read the old one's runs."""
    pattern = rf"(  class: {CLASS}\n  config:\n    base_dir: )[^\n]*"
    return re.sub(pattern, lambda m: m.group(1) + _runs_dir(home), text)


# ---- the Dagster home of a run -------------------------------------------------------------------

TELEMETRY_OFF = "telemetry:\n  enabled: false\n"
NUX_OFF = "nux:\n  enabled: false\n"
"""Dagster's "Join the Dagster community" pop-up over the UI's first page, off (dagster.yaml `nux`, read by
DagsterInstance.nux_enabled)."""


def dagster_home(output_dir: str) -> Path:
    """DAGSTER_HOME if set, else <output_dir>/dagster_home (created), so `rlake ui` shows `rlake train`'s runs.

    Its dagster.yaml switches Dagster's telemetry (and the banner it prints on first use) and the UI's "Join the
    Dagster community" pop-up (`nux`) off, unless the file already says something about them; and, unless it
    chooses a storage, selects rlake's pooled sqlite event log (PooledSqliteEventLogStorage: same files as
    Dagster's default, without a new sqlite connection per event). A Postgres-backed home (a team's shared instance) is
    checked first: check_instance_yaml."""
    home = Path(os.environ.get("DAGSTER_HOME") or Path(output_dir).resolve() / "dagster_home")
    home.mkdir(parents=True, exist_ok=True)
    conf = home / "dagster.yaml"
    text = conf.read_text() if conf.is_file() else ""
    check_instance_yaml(conf, text)
    keys = _top_keys(text)
    added = "".join(
        [
            "" if "telemetry" in keys else TELEMETRY_OFF,
            "" if "nux" in keys else NUX_OFF,
            "" if _names_storage(text) else instance_yaml(home),
        ]
    )
    new = relocate(text, home) + ("\n" if text and not text.endswith("\n") and added else "") + added
    if new != text:
        conf.write_text(new)
    os.environ["DAGSTER_HOME"] = str(home)
    return home


def _top_keys(text: str) -> set[str]:
    """The top-level keys of a dagster.yaml's text."""
    data = yaml.safe_load(text) if text.strip() else None
    return set(data) if isinstance(data, dict) else set()


def _names_storage(text: str) -> bool:
    """Whether a dagster.yaml chooses a storage itself (`storage:` e.g. Postgres, or one of the legacy keys):
    then it is left alone; else rlake's pooled sqlite event log is added."""
    return bool(_top_keys(text) & {"storage", "run_storage", "event_log_storage", "schedule_storage"})


def check_instance_yaml(conf: Path, text: str) -> None:
    """Refuse a dagster.yaml whose Postgres storage holds a password, or names the database in a form that
    cannot connect here, before Dagster fails on it with a driver traceback.

    Accepted: `postgres_url: {env: DAGSTER_PG_URL}` (the URL, password included, from the environment), or a
    literal URL without a password (libpq then reads PGPASSWORD or ~/.pgpass), with the driver named:
    `postgresql+psycopg2://user@host:5432/db`. `postgres_db:` works with `scheme: postgresql+psycopg2` and
    `password: {env: VAR}`; without the scheme, SQLAlchemy 2.1 picks psycopg 3, which is not installed."""
    if not text.strip():
        return
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{conf} is not valid YAML ({exc}); fix the file or unset DAGSTER_HOME") from None
    for where, pg in _postgres_sections(data):
        url = pg.get("postgres_url")
        if isinstance(url, str) and urlparse(url).password is not None:
            raise ValueError(
                f"{conf}: {where}.postgres_url holds a password: a dagster.yaml is shared and copied, so the "
                "password would leak with it; write `postgres_url: {env: DAGSTER_PG_URL}` and export the URL, or "
                "drop the password from the URL and set PGPASSWORD (libpq reads it)."
            )
        env = url.get("env") if isinstance(url, dict) else None
        resolved = os.environ.get(env, "") if env else url
        if isinstance(resolved, str) and urlparse(resolved).scheme == "postgresql" and not _psycopg3():
            source = f"the URL in ${env}" if env else f"'{url}'"
            raise ValueError(
                f"{conf}: {where}.postgres_url ({source}) names no driver: SQLAlchemy 2.1 then uses psycopg 3, "
                "which is not installed (rlake's cluster extra has psycopg2); write postgresql+psycopg2://..."
            )
        db = pg.get("postgres_db")
        if isinstance(db, dict):
            if isinstance(db.get("password"), str) and db["password"]:
                raise ValueError(
                    f"{conf}: {where}.postgres_db.password is written in the file, where it leaks with every "
                    "copy; write `password: {env: DAGSTER_PG_PASSWORD}` and export that variable."
                )
            if "+" not in str(db.get("scheme", "postgresql")) and not _psycopg3():
                raise ValueError(
                    f"{conf}: {where}.postgres_db has no `scheme`: SQLAlchemy 2.1 then uses psycopg 3, which is "
                    "not installed (rlake's cluster extra has psycopg2); add `scheme: postgresql+psycopg2`, or "
                    "use `postgres_url: {env: DAGSTER_PG_URL}` with a postgresql+psycopg2:// URL."
                )


def _postgres_sections(node: Any, where: str = "") -> Iterator[tuple[str, dict]]:
    """(dotted key, mapping) for every mapping in a dagster.yaml that configures a Postgres connection."""
    if isinstance(node, dict):
        if "postgres_url" in node or "postgres_db" in node:
            yield where or "(top level)", node
        for key, value in node.items():
            yield from _postgres_sections(value, f"{where}.{key}" if where else str(key))


def _psycopg3() -> bool:
    return importlib.util.find_spec("psycopg") is not None


POSTGRES_POOL = {"statement_timeout": 0, "pool_recycle": 3600, "max_overflow": 4}
"""Pooled Postgres connections for a long-lived Dagster process (`rlake train`): no statement timeout (0: an
iteration's queries are short, and a timeout would fail a run over a slow query, not speed it up), connections
recycled hourly, one kept open plus up to 4 more under concurrent use."""


def pool_postgres_connections(instance) -> bool:
    """Make a Postgres-backed instance keep its connections open, as Dagster's webserver does
    (`optimize_for_webserver`): dagster-postgres otherwise opens and closes a connection per statement batch
    (NullPool): ~340 per RL iteration, ~11 ms each with password auth (issue #37). Returns whether the instance
    uses Postgres; a sqlite home (PooledSqliteEventLogStorage pools already) is left as it is."""
    storages = (instance.run_storage, instance.event_log_storage, getattr(instance, "schedule_storage", None))
    if not any(type(s).__module__.startswith("dagster_postgres") for s in storages if s is not None):
        return False
    instance.optimize_for_webserver(**POSTGRES_POOL)
    return True


def _remember_true(obj, name: str, key: Callable[..., Hashable]) -> set:
    """Wrap method `name` of `obj` (this object only) so that a call whose `key(*args, **kwargs)` returned True
    once returns True again without calling it; False is never remembered. Returns the set of remembered keys."""
    ask, found, lock = getattr(obj, name), set(), threading.Lock()

    @functools.wraps(ask)
    def remembered(*args, **kwargs):
        k = key(*args, **kwargs)
        with lock:
            if k in found:
                return True
        if not ask(*args, **kwargs):
            return False
        with lock:
            found.add(k)
        return True

    setattr(obj, name, remembered)
    return found


def remember_schema(instance) -> None:
    """A Postgres event log's schema look-ups answered from memory once true, as PooledSqliteEventLogStorage does
    for sqlite: dagster-postgres asks the catalog whether the asset tag table exists (`has_table`) and which
    columns the asset key table has (`_has_asset_key_col_on_connection`) on every asset event it stores, the
    former on a second connection while the event's transaction holds the first (a pool of one: a new connection,
    ~11 ms with password auth, each time). Tables and columns Dagster's migrations add are never dropped while a
    process runs. A storage without these methods (another Dagster version) is left as it is."""
    storage = instance.event_log_storage
    if not type(storage).__module__.startswith("dagster_postgres"):
        return
    if callable(getattr(storage, "has_table", None)):
        _remember_true(storage, "has_table", lambda table_name: table_name)
    if callable(getattr(storage, "_has_asset_key_col_on_connection", None)):
        _remember_true(storage, "_has_asset_key_col_on_connection", lambda conn, column_name: column_name)


def remember_partition_keys(instance) -> None:
    """Answer `instance.has_dynamic_partition` from memory for a key it found in this process. Dagster asks it for
    every partitioned input and output of every step (each run x iteration key range is checked key by key, one
    query each: on the cluster's Postgres ~0.1 s of each iteration, from a py-spy profile of the driver, issue #37).
    A key found stays found: rlake adds the run's and iteration's partitions and never deletes one; a deletion made
    through this instance is forgotten here. A key not found is asked again each time (another process may add
    it). One a user deletes from another process (the UI) while this one runs stays found here until it ends."""
    found = _remember_true(
        instance,
        "has_dynamic_partition",
        lambda partitions_def_name, partition_key: (partitions_def_name, partition_key),
    )
    delete = instance.delete_dynamic_partition

    def delete_dynamic_partition(partitions_def_name: str, partition_key: str) -> None:
        found.discard((partitions_def_name, partition_key))
        delete(partitions_def_name, partition_key)

    instance.delete_dynamic_partition = delete_dynamic_partition
