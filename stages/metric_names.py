"""A metric's name in each place it is shown: one rule, in one place.

rlake names metrics as verl does (`actor/pg_loss`, `val-core/<data_source>/reward/mean@1`,
`val-core/<ds>/acc/best@8/std`). That name is used as is in the `iteration_metrics` Delta table (the
`metric` column, and so SQL and `rlake plot`), the Dagster UI (asset metadata and its Plots tab), the
terminal and the docs. MLflow alone differs: its metric keys allow only letters, digits, `_ - . / : `
and space, so `@` is written `_at_` there (`val-core/<ds>/reward/mean_at_1`), and `rlake compare`, which
reads MLflow, turns `_at_` back into `@`. No rlake metric name holds `_at_` itself, so the two
directions are inverses (tests/stages/test_validation_metrics.py).
"""

from __future__ import annotations

MLFLOW_AT = "_at_"
"""What `@` becomes in an MLflow metric key."""


def mlflow_metric_name(name: str) -> str:
    """The MLflow key of metric `name` (as in Delta and the UI): `mean@8` -> `mean_at_8`."""
    return name.replace("@", MLFLOW_AT)


def metric_name_from_mlflow(key: str) -> str:
    """The metric name (as in Delta and the UI) of MLflow key `key`: `mean_at_8` -> `mean@8`."""
    return key.replace(MLFLOW_AT, "@")
