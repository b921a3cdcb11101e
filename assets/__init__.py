"""Dagster assets: thin wrappers that read a Delta table, call a stage, write a Delta table."""
