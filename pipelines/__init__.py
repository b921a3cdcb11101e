"""Dagster definitions, jobs, sensors, resources and the `rlake` CLI."""
