"""Passwords inside URIs (`postgresql://user:PASSWORD@host/db`, `http://user:PASSWORD@mlflow`): refused in a config.

A run's config is recorded in plain text in many places: MLflow params and the config.yaml artifact, the Dagster
run's launch config (its page in the UI, the run storage's rows), Delta commit metadata, the terminal and the
framework logs. A password written in any of its URIs (trainer.mlflow_tracking_uri, storage.options values, ...)
would leak into all of them, so a config holding one fails to load (RunConfig's validator calls
`refuse_uri_passwords`) and the message says which environment variable carries it instead: nothing downstream
ever holds the secret. `redact` masks such passwords in free text (an error message, a log line) for code that
prints something that did not come from a config.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

URI_PASSWORD = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*):(?P<password>[^/\s@]+)@")
"""`scheme://user:password@`: the password part of a URI's userinfo."""
MASK = "***"


def redact(text: str) -> str:
    """`text` with the password of every URI in it replaced by ***."""
    return URI_PASSWORD.sub(lambda m: f"{m.group('head')}:{MASK}@", str(text))


def uri_passwords(tree: Any, where: str = "") -> Iterator[tuple[str, str]]:
    """(dotted path, value) of the string values in a config tree (dicts, lists) holding a URI with a password."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from uri_passwords(value, f"{where}.{key}" if where else str(key))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from uri_passwords(value, f"{where}[{i}]")
    elif isinstance(tree, str) and URI_PASSWORD.search(tree):
        yield where, tree


def refuse_uri_passwords(tree: Any) -> None:
    """Raise ValueError naming every field of config tree `tree` whose URI holds a password (see the module)."""
    found = list(uri_passwords(tree))
    if not found:
        return
    values = ", ".join(f"{path}={redact(value)!r}" for path, value in found)
    raise ValueError(
        f"{values}: a URI in a config holds a password, and a config is recorded in MLflow params, its config.yaml "
        "artifact, Dagster run records, Delta commit metadata and logs, where the password would leak. Drop the "
        "password from the URI and give it through the environment: PGPASSWORD or ~/.pgpass for postgresql:// "
        "(libpq reads them), MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD for an http(s):// MLflow server, "
        "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY for storage."
    )
