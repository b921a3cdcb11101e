"""Checks of a run's input before any expensive work (warm start, Ray, Dagster).

`rlake train` calls `preflight(cfg)` right after loading the config, so bad input fails in about a
second with a what / why / fix message instead of minutes into a run: malformed or missing parquet
columns, an unknown data_source, too few prompts, prompts over data.max_prompt_length, and a
model.path that is not a causal-LM checkpoint.
"""
from __future__ import annotations

from pathlib import Path


def preflight_tokenizer(model_cfg):
    """The tokenizer the run will use, without loading weights (None when it is built later, e.g. a GGUF)."""
    if model_cfg.path == "tiny":
        from stages.models.tiny import build_char_tokenizer

        return build_char_tokenizer()
    if not Path(model_cfg.path).is_dir():
        return None  # a named model that a stage builds (stages/initial_policy.py) validates itself
    from stages.models.policy import load_tokenizer
    from stages.run.resume import check_causal_lm_dir

    check_causal_lm_dir(model_cfg.path, what="model.path")
    return load_tokenizer(model_cfg.path)


def preflight(cfg) -> dict:
    """Validate data and model input of RunConfig `cfg`; returns counts (rows, train, longest prompt)."""
    from stages.prompts import build_prompt_rows
    from stages.prompt_batch import tokenize_prompts

    rows = build_prompt_rows(cfg)  # parquet columns and types, data_source, train_batch_size <= prompts
    out = {"rows": len(rows), "train": int((rows["split"] == "train").sum())}
    tok = preflight_tokenizer(cfg.model)
    if tok is not None:
        ids, _ = tokenize_prompts(list(rows["prompt"]), tok, cfg.data.max_prompt_length,
                                  prompt_ids=list(rows["prompt_id"]))
        out["longest_prompt"] = max(len(x) for x in ids)
    return out


def explain_config_error(exc) -> ValueError:
    """A pydantic ValidationError of RunConfig as one what / why / fix message per problem."""
    import difflib

    from configs.schema import RunConfig

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
            lines.append(f"unknown config key '{key}' (value {err['input']!r}): configs reject unknown keys so a "
                         f"typo cannot be silently ignored; {hint}")
        elif err["type"] == "value_error":
            lines.append(err["msg"].removeprefix("Value error, "))
        else:
            lines.append(f"config key '{key or '<root>'}': {err['msg']} (got {err.get('input')!r}); "
                         "configs/_defaults.yaml lists every key with a valid value.")
    return ValueError("invalid config:\n  " + "\n  ".join(lines))
