"""SQL over rlake's Delta tables: DuckDB reading each table's Arrow dataset (no extension download).

The tables root is a storage URI (stages/io/uris.py): a local directory or `s3://bucket/prefix/tables`,
opened with `storage_options` (delta-rs options; credentials from the environment). Each table under the
root becomes a view of its `DeltaTable(...).to_pyarrow_dataset()`, so DuckDB reads local and remote tables
alike, at any version (time travel)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from pathlib import Path

import duckdb
import pandas as pd
from deltalake.exceptions import DeltaError

from stages.io import store, uris


def connect(
    tables_root: str | Path, versions: dict[str, int] | None = None, *, storage_options: Mapping[str, str] | None = None
):
    """A DuckDB connection with one view per Delta table under tables_root (optionally time-travelled)."""
    root = uris.normalize(tables_root)
    opts = uris.options_of(tables_root, storage_options)
    try:
        names = uris.list_dirs(root, opts)
    except FileNotFoundError:
        names = None
    if names is None or (not uris.is_local(root) and not names):
        raise FileNotFoundError(
            f"no tables under '{root}': run `rlake train` first, or point at the run's tables with --tables / "
            "--config (storage.root, trainer.output_dir)"
        )
    versions = dict(versions or {})
    con = duckdb.connect()
    found = []
    for name in names:
        uri = uris.join(root, name)
        if store.table_exists(uri, storage_options=opts):
            con.register(name, _dataset(uri, name, versions.pop(name, None), opts))
            found.append(name)
    for key in [k for k in versions if ":" in k]:  # ALIAS:TABLE=N adds view ALIAS = TABLE at version N
        alias, _, name = key.partition(":")
        if name not in found:
            raise ValueError(f"--version {key}={versions[key]}: no table '{name}'; tables: {found}")
        con.register(alias, _dataset(uris.join(root, name), key, versions.pop(key), opts))
    if versions:
        raise ValueError(f"--version names unknown tables {sorted(versions)}; tables: {found}")
    return con


def _dataset(uri: str, key: str, version: int | None, storage_options: Mapping[str, str] | None):
    """The table's Arrow dataset at `version` (latest when None); a version it lacks is a ValueError."""
    try:
        return store.open_table(uri, version=version, storage_options=storage_options).to_pyarrow_dataset()
    except DeltaError as exc:
        if version is None:
            raise
        latest = store.table_version(uri, storage_options=storage_options)
        why = f"the newest is {latest}" if version > latest else str(exc).splitlines()[0]
        raise ValueError(
            f"--version {key}={version}: cannot open table '{uris.name(uri)}' at that version: {why}"
        ) from exc


def query(
    tables_root: str | Path,
    sql: str,
    versions: dict[str, int] | None = None,
    *,
    storage_options: Mapping[str, str] | None = None,
) -> pd.DataFrame:
    """Run `sql` over the tables; a DuckDB error becomes a one-line ValueError naming what exists."""
    con = connect(tables_root, versions, storage_options=storage_options)
    try:
        return con.execute(sql).fetchdf()
    except duckdb.Error as exc:
        raise ValueError(explain_error(con, sql, exc)) from exc


ALL_COLUMNS_MAX = 40
"""An unknown column lists every table's columns when they total at most this many; else only the
columns of the tables the query names."""
_COLUMN = re.compile(r'[Cc]olumn (?:named |with name )?"([^"]+)"')
_TABLE = re.compile(r'Table with name "?([^"\s!]+)"? does not exist|Referenced table "([^"]+)" not found')


def explain_error(con, sql: str, exc: Exception) -> str:
    """One line: DuckDB's first line, a did-you-mean, and the tables (with columns) that exist."""
    first = str(exc).strip().splitlines()[0].rstrip("!") if str(exc).strip() else type(exc).__name__
    try:
        rows = con.execute(
            "SELECT table_name, column_name FROM information_schema.columns ORDER BY table_name, ordinal_position"
        ).fetchall()
    except duckdb.Error:  # the connection itself is gone (interrupt, out of memory): DuckDB's line alone
        return first
    columns: dict[str, list[str]] = {}
    for table, column in rows:
        columns.setdefault(table, []).append(column)
    tables = sorted(columns)
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", sql.lower()))
    named = [t for t in tables if t.lower() in words]
    column, table = _COLUMN.search(first), _TABLE.search(first)
    if column and not table:
        shown = tables if sum(len(c) for c in columns.values()) <= ALL_COLUMNS_MAX or not named else named
        candidates = sorted({c for t in shown for c in columns[t]})
        where = "; ".join(f"{t}({', '.join(columns[t])})" for t in shown)
        return first + _did_you_mean(column.group(1), candidates) + f"; columns: {where}"
    listing = f"; tables: {', '.join(tables) or '(none)'}"
    if table:
        return first + _did_you_mean(table.group(1) or table.group(2), tables) + listing
    return first + listing if isinstance(exc, duckdb.ProgrammingError) else first  # syntax/catalog vs data errors


def _did_you_mean(name: str, candidates: list[str]) -> str:
    """' (did you mean 'reward'?)' for the close candidates, compared case-insensitively as DuckDB does."""
    lower = {c.lower(): c for c in candidates}
    close = difflib.get_close_matches(name.lower(), list(lower), n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(lower[c]) for c in close)}?)" if close else ""
