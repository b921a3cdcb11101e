"""Datasets in verl's format, the synthetic tasks and the rule-based reward functions."""
