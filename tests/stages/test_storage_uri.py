"""Storage URIs without a server: `s3://bucket/prefix` survives every join that builds a table root or a table URI
(the pathlib bug turned it into `s3:/bucket/prefix`), options travel with a StorageURI, and the local default keeps
today's plain paths. The same code against a real S3 server: tests/stages/test_storage_s3.py."""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path

import cloudpickle
import pandas as pd
import pytest

from assets.resources import RolloutStoreResource
from configs.errors import load_run_config
from pipelines import cli
from pipelines.resources import _rollout_store, tables_root
from stages.io import store, uris

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "ci_tiny.yaml")
OPTIONS = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}


def _cfg(tmp_path: Path, *overrides: str):
    return load_run_config(CONFIG, [f"trainer.output_dir={tmp_path / 'out'}", *overrides])


@pytest.mark.parametrize("root", ["s3://b/t", "s3://b/t/"])
def test_s3_root_survives_every_join(root: str, tmp_path: Path) -> None:
    assert str(Path(root) / "tables") == "s3:/b/t/tables"  # the bug: pathlib collapses the scheme's '//'
    assert uris.join(root, "tables", "rollouts") == "s3://b/t/tables/rollouts"
    assert uris.join(uris.join(root, "tables/"), "/rollouts/") == "s3://b/t/tables/rollouts"
    assert uris.normalize(root) == "s3://b/t"
    cfg = _cfg(tmp_path, f"storage.root={root}", f"storage.options={OPTIONS}")
    assert uris.storage_root(cfg) == "s3://b/t"
    assert uris.tables_root(cfg) == tables_root(cfg) == "s3://b/t/tables"
    assert uris.checkpoints_root(cfg) == "s3://b/t/checkpoints"
    assert uris.table_uri(cfg, "advantages") == "s3://b/t/tables/advantages"  # replay's update request
    res = _rollout_store(cfg)  # what every asset gets
    assert res.root == "s3://b/t/tables" and res.storage_options == OPTIONS
    assert res.uri("rollouts") == "s3://b/t/tables/rollouts" and res.location == "s3://b/t/tables"
    assert RolloutStoreResource(root=root).uri("prompts") == "s3://b/t/prompts"
    args = argparse.Namespace(tables=None, config=CONFIG, override=[f"storage.root={root}"])
    assert cli._tables_root(args) == "s3://b/t/tables"  # rlake sql / lineage / plot
    args = argparse.Namespace(tables=root.rstrip("/") + "/tables/", config=CONFIG, override=[])
    assert cli._tables_root(args) == "s3://b/t/tables"


def test_options_travel_with_the_uri(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "storage.root=s3://b/run", f"storage.options={OPTIONS}")
    uri = _rollout_store(cfg).uri("advantages")
    assert isinstance(uri, uris.StorageURI) and uri.storage_options == OPTIONS
    for dumps, loads in ((pickle.dumps, pickle.loads), (cloudpickle.dumps, cloudpickle.loads)):  # a Ray request
        back = loads(dumps(uri))
        assert back == "s3://b/run/tables/advantages" and back.storage_options == OPTIONS
    assert uris.join(uri, "x").storage_options == OPTIONS and type(uris.normalize(uri + "")) is str
    assert uris.options_of(uri) == OPTIONS
    assert uris.options_of(uri, {"AWS_REGION": "eu-west-1"}) == {"AWS_REGION": "eu-west-1"}  # explicit wins
    assert uris.options_of("s3://b/t") is None and uris.options_of(str(uri)) is None  # str() drops them
    assert uris.options_of(uris.StorageURI("/tmp/x", OPTIONS)) is None  # delta-rs takes none for local paths
    args = argparse.Namespace(
        tables=None, config=CONFIG, override=["storage.root=s3://b/run", f"storage.options={OPTIONS}"]
    )
    assert cli._tables_root(args).storage_options == OPTIONS


def test_local_default_is_todays_layout(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    out = (tmp_path / "out").resolve()
    assert tables_root(cfg) == str(out / "tables") and uris.checkpoints_root(cfg) == str(out / "checkpoints")
    res = _rollout_store(cfg)
    assert res.storage_options == {} and res.uri("rollouts") == str(out / "tables" / "rollouts")
    assert type(res.uri("rollouts")) is str  # nothing carried for a local table
    assert uris.storage_options(cfg) is None
    file_root = _cfg(tmp_path, f"storage.root={(tmp_path / 'elsewhere').as_uri()}")
    assert uris.tables_root(file_root) == str((tmp_path / "elsewhere" / "tables").resolve())


def test_file_uri_table_is_the_plain_path(tmp_path: Path) -> None:
    """A file:// URI opens the same Delta table as its path (delta-rs gets the path, not the URI)."""
    uri = (tmp_path / "t").as_uri()
    df = pd.DataFrame({"policy_version": [1], "metric": ["a"], "value": [2.0]})
    v = store.write_partition(uri, "iteration_metrics", df, run_id="r", iteration=0, lineage={"stage": "s"})
    assert v == 0 and store.table_exists(str(tmp_path / "t"))
    assert store.read_partition(str(tmp_path / "t"), "r", 0)["value"].tolist() == [2.0]
    assert store.commit_lineage(uri)[0]["stage"] == "s"


def test_unknown_scheme_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"scheme 'gs://'.*knows file://, s3://.*s3://bucket/prefix"):
        uris.join("gs://b/t", "tables")
    with pytest.raises(ValueError, match="not on the local file system"):
        uris.local_path("s3://b/t")


def test_obstore_config_from_delta_options() -> None:
    """The listing `rlake sql` does on a bucket (obstore) takes the same storage.options as delta-rs."""
    config, client = uris.obstore_config({**OPTIONS, "timeout": "30s", "endpoint": "http://x"})
    assert config == {"aws_endpoint_url": "http://127.0.0.1:9", "aws_region": "us-east-1", "aws_endpoint": "http://x"}
    assert client == {"allow_http": True, "timeout": "30s"}
