"""A config that does not validate, as one what / why / fix message per problem.

`load_run_config` is how the CLI (`rlake train`, `rlake config`, `rlake replay`) parses a config: it
imports only configs/, so a typo is reported before torch or Dagster load.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from configs.schema import RunConfig, load_config
from configs.secrets import redact


def load_run_config(path: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """The RunConfig of YAML `path` with `key.sub=value` overrides; a config that does not validate raises
    the ValueError of `explain_config_error`."""
    try:
        return load_config(path, list(overrides))
    except ValidationError as exc:
        raise explain_config_error(exc) from None


def explain_config_error(exc: ValidationError) -> ValueError:
    """A pydantic ValidationError of RunConfig as one what / why / fix message per problem."""
    lines = []
    for err in exc.errors():
        loc = [str(x) for x in err["loc"]]
        key = ".".join(loc)
        if err["type"] == "extra_forbidden":
            model = RunConfig
            for part in loc[:-1]:
                ann = model.model_fields[part].annotation if part in getattr(model, "model_fields", {}) else None
                model = ann if isinstance(ann, type) else None
                if model is None:
                    break
            known = sorted(model.model_fields) if model is not None else []
            close = difflib.get_close_matches(loc[-1], known, n=1)
            hint = f"did you mean '{'.'.join(loc[:-1] + close)}'?" if close else f"valid keys here: {known}"
            lines.append(
                f"unknown config key '{key}' (value {err['input']!r}): configs reject unknown keys so a "
                f"typo cannot be silently ignored; {hint}"
            )
        elif err["type"] == "value_error":
            lines.append(err["msg"].removeprefix("Value error, "))
        else:
            lines.append(
                f"config key '{key or '<root>'}': {err['msg']} (got {err.get('input')!r}); "
                f"{_hash_note(err.get('input'))}configs/_defaults.yaml lists every key with a valid value."
            )
    return ValueError(redact("invalid config:\n  " + "\n  ".join(lines)))  # a value quoted back keeps no password


def _hash_note(value: object) -> str:
    """Why a value holds a '#' (a `key=value` override keeps it as text: configs.compose.override_value)."""
    if not (isinstance(value, str) and "#" in value):
        return ""
    return (
        "a '#' in a key=value override is text, not a YAML comment (the shell has removed comments already), so "
        "the value is the whole string; drop the '#' part, or in a YAML file put it after a space as a comment; "
    )
