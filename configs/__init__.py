"""Pydantic configuration models for rlake (see schema.py)."""

from configs.schema import RunConfig, dump_defaults, load_config

__all__ = ["RunConfig", "dump_defaults", "load_config"]
