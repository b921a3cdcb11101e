"""A password inside a URI never enters a run's config (configs/secrets.py), so no sink records it.

A config is recorded in MLflow params, the config.yaml artifact, Dagster run records and Delta commit metadata, and
echoed on the terminal: a URI with a password in any field is refused at load, through the real CLI, with a
message that names the field, masks the password and says which environment variable carries it instead.
"""

from __future__ import annotations

import pytest

from configs.errors import load_run_config
from configs.secrets import redact, uri_passwords
from pipelines.cli import main

SECRET = "hunter2-not-in-any-log"
CI = "configs/ci_tiny.yaml"


def test_redact_masks_the_password_of_every_uri() -> None:
    text = f"a postgresql+psycopg2://u:{SECRET}@127.0.0.1:5432/db and http://bob:{SECRET}@mlflow:5000/x"
    out = redact(text)
    assert SECRET not in out
    assert "postgresql+psycopg2://u:***@127.0.0.1:5432/db" in out and "http://bob:***@mlflow:5000/x" in out
    for safe in ("postgresql+psycopg2://u@127.0.0.1/db", "s3://bucket/prefix", "http://127.0.0.1:5000", "a:b@c"):
        assert redact(safe) == safe
    tree = {"trainer": {"mlflow_tracking_uri": f"postgresql://u:{SECRET}@h/db"}, "x": [f"http://a:{SECRET}@h"]}
    assert [p for p, _ in uri_passwords(tree)] == ["trainer.mlflow_tracking_uri", "x[0]"]


@pytest.mark.parametrize(
    "override, field",
    [
        (f"trainer.mlflow_tracking_uri=postgresql://u:{SECRET}@127.0.0.1/db", "trainer.mlflow_tracking_uri"),
        (
            f"storage.options={{AWS_ENDPOINT_URL: 'http://k:{SECRET}@127.0.0.1:8333'}}",
            "storage.options.AWS_ENDPOINT_URL",
        ),
    ],
    ids=["mlflow_tracking_uri", "storage_options"],
)
def test_a_uri_with_a_password_is_refused_and_not_echoed(override: str, field: str, tmp_path, capsys) -> None:
    with pytest.raises(ValueError) as exc:
        load_run_config(CI, [override])
    msg = str(exc.value)
    assert field in msg and "***" in msg and "PGPASSWORD" in msg and SECRET not in msg
    rc = main(["train", "--config", CI, "--run-id", "pw", f"trainer.output_dir={tmp_path}", override])
    out = capsys.readouterr()
    assert rc == 2 and field in out.err
    assert SECRET not in out.err + out.out
    assert not list(tmp_path.iterdir())  # refused before anything was recorded


def test_a_uri_without_a_password_loads() -> None:
    cfg = load_run_config(CI, ["trainer.mlflow_tracking_uri=postgresql+psycopg2://u@127.0.0.1:5432/mlflow"])
    assert cfg.trainer.mlflow_tracking_uri.endswith("/mlflow")


def test_an_unknown_key_is_echoed_without_its_password() -> None:
    with pytest.raises(ValueError, match="unknown config key") as exc:
        load_run_config(CI, [f"trainer.mlflow_uri=postgresql://u:{SECRET}@h/db"])
    assert SECRET not in str(exc.value)
