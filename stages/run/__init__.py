"""Whole-run operations: resume, preflight, replay, compare, export, seeds."""
