"""Delta Lake table I/O with lineage: every commit carries run id, iteration, policy version,
config hash, code version and the versions of the upstream tables the stage read.

Tables are partitioned by (run_id, iteration); a write replaces exactly its own partition
(`predicate`), so a retried or re-materialized stage never duplicates rows and never touches
other iterations.

A table is named by a storage URI (stages/io/uris.py): a local path or `file://` URI, or `s3://bucket/...`.
Every function takes `storage_options` (delta-rs options: endpoint, region, allow_http; None for local),
defaulting to the options a StorageURI carries; credentials come from the process environment
(AWS_ACCESS_KEY_ID, ...), never from the options, so they never reach a commit's metadata.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, write_deltalake

from stages.io import uris
from stages.io.tables import COLUMN_DEFAULTS, COMMIT_SETS, EXTRA_COLUMNS, SCHEMAS

LINEAGE_PREFIX = "rlake."


CHECKOUT = Path(__file__).resolve().parents[2]
"""Where rlake's source lives (stages/io/store.py -> the repository root in a git checkout)."""


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=CHECKOUT, capture_output=True, text=True, timeout=5, check=True
    ).stdout.strip()


@lru_cache(maxsize=1)
def git_commit() -> str | None:
    """Full commit sha of the checkout rlake's source lives in; None when it is not a git checkout."""
    try:
        out = _git("rev-parse", "--show-toplevel", "HEAD").split()
    except (OSError, subprocess.SubprocessError):
        return None
    # an installed copy (site-packages) inside some other repository is not rlake's checkout
    return out[1] if len(out) == 2 and Path(out[0]).resolve() == CHECKOUT else None


@lru_cache(maxsize=1)
def code_version() -> str:
    """Git commit of the rlake checkout (12 hex digits, '+dirty' when modified), else the package version."""
    sha = git_commit()
    if sha is not None:
        try:
            return sha[:12] + ("+dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        return "rlake-" + version("rlake")
    except PackageNotFoundError:
        return "unknown"


Options = Mapping[str, str] | None
"""delta-rs storage_options of a table URI (None: local, or taken from a StorageURI / the environment)."""


def _open(uri: str, storage_options: Options) -> tuple[str, dict[str, str] | None]:
    """(what delta-rs opens, its storage_options): explicit options, else those `uri` carries."""
    return uris.target(uri), uris.options_of(uri, storage_options)


def open_table(uri: str, *, version: int | None = None, storage_options: Options = None) -> DeltaTable:
    """The DeltaTable at `uri` (optionally at `version`), opened with the URI's storage options."""
    path, opts = _open(uri, storage_options)
    return DeltaTable(path, version=version, storage_options=opts)


def table_exists(uri: str, *, storage_options: Options = None) -> bool:
    path, opts = _open(uri, storage_options)
    return DeltaTable.is_deltatable(path, storage_options=opts)


def to_arrow(name: str, df: pd.DataFrame) -> pa.Table:
    """Cast a DataFrame to the table's declared schema (fails loudly on a missing column)."""
    schema = SCHEMAS[name]
    fill = {k: [v] * len(df) for k, v in COLUMN_DEFAULTS.items() if k in schema.names and k not in df.columns}
    df = df.assign(**fill) if fill else df
    missing = [f.name for f in schema if f.name not in df.columns]
    if missing:
        raise ValueError(f"table '{name}': DataFrame lacks columns {missing}; has {list(df.columns)}")
    table = pa.Table.from_pandas(df[[f.name for f in schema]], schema=schema, preserve_index=False)
    for column in extra_columns(name, df):
        try:
            values = pa.array(df[column].tolist(), from_pandas=True)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise ValueError(f"table '{name}': extra column '{column}' holds values of mixed types: {exc}") from exc
        if values.null_count < len(values):  # an all-null column has no type Delta can store: left out
            table = table.append_column(column, values)
    return table


def extra_columns(name: str, df: pd.DataFrame) -> list[str]:
    """The columns beyond its schema that table `name` keeps (tables.EXTRA_COLUMNS), sorted; one that would
    replace a schema column is a ValueError."""
    if name not in EXTRA_COLUMNS or EXTRA_COLUMNS[name] not in df.columns:
        return []
    names = sorted({str(k) for keys in df[EXTRA_COLUMNS[name]] if keys is not None for k in keys})
    taken = [k for k in names if k in SCHEMAS[name].names or k in ("run_id", "iteration")]
    if taken:
        raise ValueError(f"table '{name}': extra columns {taken} would replace its own columns of the same names")
    missing = [k for k in names if k not in df.columns]
    if missing:
        raise ValueError(f"table '{name}': rows name extra columns {missing} the DataFrame lacks")
    return names


def write_partition(
    uri: str,
    name: str,
    df: pd.DataFrame,
    *,
    run_id: str,
    iteration: int,
    lineage: dict[str, Any],
    storage_options: Options = None,
) -> int:
    """Replace partition (run_id, iteration) of table `name` at `uri`; returns the new version."""
    if not len(df):
        raise ValueError(
            f"refusing to write an empty partition of '{name}' (run {run_id}, iteration "
            f"{iteration}): an empty stage output means an upstream stage produced nothing"
        )
    data = to_arrow(name, df.assign(run_id=run_id, iteration=iteration))
    props = CommitProperties(custom_metadata=commit_metadata(name, data, run_id, iteration, lineage))
    path, opts = _open(uri, storage_options)
    if not DeltaTable.is_deltatable(path, storage_options=opts):
        write_deltalake(
            path,
            data,
            mode="append",
            partition_by=["run_id", "iteration"],
            commit_properties=props,
            storage_options=opts,
        )
    else:
        safe_run = run_id.replace("'", "''")
        # schema_mode=merge: a table written by an older rlake gains the new columns (null in old rows)
        # instead of refusing a resumed run's writes
        write_deltalake(
            path,
            data,
            mode="overwrite",
            predicate=f"run_id = '{safe_run}' AND iteration = {iteration}",
            commit_properties=props,
            schema_mode="merge",
            storage_options=opts,
        )
    return DeltaTable(path, storage_options=opts).version()


def commit_metadata(name: str, data: pa.Table, run_id: str, iteration: int, lineage: dict[str, Any]) -> dict[str, str]:
    """The rlake.* commit metadata of a write: the stage's lineage plus run, iteration, table, code version and
    the value sets of COMMIT_SETS columns. Never a storage option or credential."""
    meta = {LINEAGE_PREFIX + k: (v if isinstance(v, str) else json.dumps(v)) for k, v in lineage.items()}
    meta |= {
        LINEAGE_PREFIX + "run_id": run_id,
        LINEAGE_PREFIX + "iteration": str(iteration),
        LINEAGE_PREFIX + "table": name,
        LINEAGE_PREFIX + "code_version": code_version(),
    }
    for column, key in COMMIT_SETS.items():  # e.g. every reward version that scored the rows written
        if column in data.column_names:
            meta[LINEAGE_PREFIX + key] = json.dumps(sorted({v for v in data[column].to_pylist() if v is not None}))
    return meta


def read_partition(
    uri: str,
    run_id: str,
    iteration: int,
    *,
    version: int | None = None,
    columns: list[str] | None = None,
    storage_options: Options = None,
) -> pd.DataFrame:
    """Rows of one (run_id, iteration) partition, optionally at a table version (time travel)."""
    if not table_exists(uri, storage_options=storage_options):
        raise FileNotFoundError(f"no Delta table at '{uri}': materialize its asset first")
    dt = open_table(uri, version=version, storage_options=storage_options)
    df = dt.to_pandas(partitions=[("run_id", "=", run_id), ("iteration", "=", str(iteration))], columns=columns)
    if not len(df):
        raise LookupError(
            f"table '{uri}' (version {dt.version()}) has no rows for run '{run_id}' iteration "
            f"{iteration}: materialize that partition of its asset first"
        )
    return df


def table_version(uri: str, *, storage_options: Options = None) -> int:
    return open_table(uri, storage_options=storage_options).version()


def commit_lineage(
    uri: str, *, run_id: str | None = None, iteration: int | None = None, storage_options: Options = None
) -> list[dict[str, Any]]:
    """The rlake lineage of every commit (newest first), optionally for one run / iteration."""
    out = []
    for entry in open_table(uri, storage_options=storage_options).history():
        meta = {k[len(LINEAGE_PREFIX) :]: v for k, v in entry.items() if k.startswith(LINEAGE_PREFIX)}
        if not meta:
            continue
        if run_id is not None and meta.get("run_id") != run_id:
            continue
        if iteration is not None and meta.get("iteration") != str(iteration):
            continue
        for key in ("upstream", *COMMIT_SETS.values()):
            if key in meta:
                meta[key] = json.loads(meta[key])
        out.append({"version": entry.get("version"), "timestamp": entry.get("timestamp"), **meta})
    return out
