"""Whole-run operations: resume, preflight, replay, compare, export, seeds; the machine a run's numbers came from."""
