"""`rlake sql` on real Delta tables: a bad query is one stderr line naming what exists, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest

from pipelines.cli import main
from stages.io import store
from stages.io.tables import SCHEMAS

_VALUE = {
    pa.string(): "x",
    pa.int64(): 1,
    pa.int32(): 1,
    pa.float64(): 0.5,
    pa.bool_(): False,
    pa.list_(pa.string()): [],
}


def _rows(name: str, n: int = 2) -> pd.DataFrame:
    """n rows of table `name` with a plain value for every declared column (lists get [1], string lists [],
    lists of structs (multi-turn `turns`) null)."""
    schema = SCHEMAS[name]

    def value(t: pa.DataType):
        if pa.types.is_list(t) and pa.types.is_struct(t.value_type):
            return None
        return _VALUE.get(t, [1])

    return pd.DataFrame({f.name: [value(f.type)] * n for f in schema if f.name not in ("run_id", "iteration")})


@pytest.fixture
def tables(tmp_path: Path) -> Path:
    """scored_rollouts (30 columns) and iteration_metrics (5): 35 columns, few enough to list all."""
    root = tmp_path / "tables"
    for name in ("scored_rollouts", "iteration_metrics"):
        store.write_partition(str(root / name), name, _rows(name), run_id="r", iteration=0, lineage={})
    return root


def _sql_error(capsys, root: Path, sql: str, *extra: str) -> str:
    rc = main(["sql", "--tables", str(root), *extra, sql])
    captured = capsys.readouterr()
    assert rc == 2, captured.out
    err = captured.err
    assert err.startswith("rlake sql: error: "), err
    assert err.count("\n") == 1 and "Traceback" not in err, err  # one line
    return err


def test_sql_ok(tables, capsys):
    assert main(["sql", "--tables", str(tables), "SELECT count(*) AS n, sum(reward) AS r FROM scored_rollouts"]) == 0
    assert "1.0" in capsys.readouterr().out


def test_unknown_column_names_columns_and_suggests(tables, capsys):
    err = _sql_error(capsys, tables, "SELECT rewrd FROM scored_rollouts")
    assert 'Referenced column "rewrd" not found' in err
    assert "(did you mean 'reward' or " in err  # the closest first
    assert "scored_rollouts(run_id, iteration, policy_version" in err and "reward_extra_keys)" in err
    assert "iteration_metrics(run_id, iteration, policy_version, metric, value)" in err  # all tables: 35 columns


def test_unknown_column_many_tables_lists_only_named(tables, capsys):
    store.write_partition(str(tables / "rollouts"), "rollouts", _rows("rollouts"), run_id="r", iteration=0, lineage={})
    err = _sql_error(capsys, tables, "SELECT METRC FROM iteration_metrics")  # 56 columns in all: only the named table
    assert "did you mean 'metric'?" in err  # case-insensitive, as DuckDB resolves names
    assert "columns: iteration_metrics(run_id, iteration, policy_version, metric, value)" in err
    assert "scored_rollouts" not in err and "rollouts(" not in err


def test_unknown_table_lists_tables(tables, capsys):
    err = _sql_error(capsys, tables, "SELECT * FROM scored_rolouts")
    assert "scored_rolouts does not exist" in err
    assert "did you mean 'scored_rollouts'?" in err
    assert err.rstrip().endswith("tables: iteration_metrics, scored_rollouts")


def test_syntax_error(tables, capsys):
    err = _sql_error(capsys, tables, "SELEC reward FROM scored_rollouts")
    assert 'syntax error at or near "SELEC"' in err
    assert "tables: iteration_metrics, scored_rollouts" in err


def test_alias_and_bad_version(tables, capsys):
    err = _sql_error(capsys, tables, "SELECT valu FROM old", "--version", "old:iteration_metrics=0")
    assert "did you mean 'value'?" in err and "old(run_id" in err
    err = _sql_error(capsys, tables, "SELECT 1", "--version", "scored_rollouts=9")
    assert "--version scored_rollouts=9: cannot open table 'scored_rollouts' at that version: the newest is 0" in err
    err = _sql_error(capsys, tables, "SELECT 1", "--version", "scored_rollouts=latest")
    assert "--version expects TABLE=N" in err
