#!/usr/bin/env bash
# Lint: the formatter's check and the linter, both configured in pyproject.toml ([tool.ruff]); exits non-zero
# on the first that fails. Fix with `ruff format . && ruff check --fix .` (review the diff), then rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff --version
ruff format --check .
ruff check .
