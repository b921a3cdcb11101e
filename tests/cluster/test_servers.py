"""The cluster fixtures themselves: each server is real, answers, and listens on 127.0.0.1 only."""

from __future__ import annotations

import psutil
import pytest
from deltalake import DeltaTable, write_deltalake

pytestmark = pytest.mark.cluster


def _listening(pid: int) -> set[str]:
    """The addresses the server process and its children listen on (a child that exits meanwhile is skipped)."""
    out = set()
    for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            out |= {c.laddr.ip for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
        except (psutil.NoSuchProcess, psutil.ZombieProcess, FileNotFoundError):
            continue
    assert out, f"process {pid} listens on nothing: the check would pass vacuously"
    return out


def test_s3_server_is_real_and_loopback_only(s3_env):
    import pandas as pd

    uri = s3_env.root("fixture/t")
    write_deltalake(uri, pd.DataFrame({"a": [1, 2]}), mode="append")
    assert DeltaTable(uri).to_pandas().a.tolist() == [1, 2]
    assert any(k.startswith("fixture/t/_delta_log/") for k in s3_env.keys("fixture/"))
    assert _listening(s3_env.proc.pid) <= {"127.0.0.1"}


def test_postgres_server_is_real_and_loopback_only(postgres_server):
    import sqlalchemy as sa

    engine = sa.create_engine(postgres_server.create_db("fixture_check"))
    with engine.connect() as con:
        assert con.execute(sa.text("select 1 + 1")).scalar() == 2
    engine.dispose()
    pid = int((postgres_server.datadir / "postmaster.pid").read_text().split()[0])
    assert _listening(pid) <= {"127.0.0.1"}
