"""Shared pieces of the config sections: the strict, frozen pydantic base and the credential check."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


CREDENTIAL_KEY = re.compile(r"secret|password|passwd|token|credential|session|access_key", re.IGNORECASE)
"""Option names that hold credentials: refused in a config (they would reach MLflow params and commit metadata)."""


def _refuse_credentials(where: str, options: dict[str, Any]) -> None:
    bad = sorted(k for k in options if CREDENTIAL_KEY.search(str(k)))
    if bad:
        raise ValueError(
            f"{where} names credentials {bad}: a config is logged to MLflow params, Dagster run configs and Delta "
            "commit metadata, so a secret in it would leak; remove them and set them in the environment instead "
            "(e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, read by delta-rs and every rlake worker; name them in "
            "ray.runtime_env.env_vars_from to forward them to the cluster)."
        )
