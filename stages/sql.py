"""SQL over rlake's Delta tables: DuckDB reading each table's Arrow dataset (no extension download)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
from deltalake import DeltaTable


def connect(tables_root: str | Path, versions: dict[str, int] | None = None):
    """A DuckDB connection with one view per Delta table under tables_root (optionally time-travelled)."""
    import duckdb

    root = Path(tables_root)
    if not root.is_dir():
        raise FileNotFoundError(f"no tables under '{root}': run `rlake train` first or pass --tables")
    versions = dict(versions or {})
    con = duckdb.connect()
    found = []
    for path in sorted(p for p in root.iterdir() if DeltaTable.is_deltatable(str(p))):
        dt = DeltaTable(str(path), version=versions.pop(path.name, None))
        con.register(path.name, dt.to_pyarrow_dataset())
        found.append(path.name)
    for key in [k for k in versions if ":" in k]:  # ALIAS:TABLE=N adds view ALIAS = TABLE at version N
        alias, _, name = key.partition(":")
        if name not in found:
            raise ValueError(f"--version {key}={versions[key]}: no table '{name}'; tables: {found}")
        con.register(alias, DeltaTable(str(root / name), version=versions.pop(key)).to_pyarrow_dataset())
    if versions:
        raise ValueError(f"--version names unknown tables {sorted(versions)}; tables: {found}")
    return con


def query(tables_root: str | Path, sql: str, versions: dict[str, int] | None = None) -> pd.DataFrame:
    return connect(tables_root, versions).execute(sql).fetchdf()
