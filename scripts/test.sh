#!/usr/bin/env bash
# The README's test command: the whole suite on real components (local Ray, Delta, MLflow, Dagster).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_ACCEPT_CLOUD_SDK_WARNING=1 PYTHONUNBUFFERED=1
exec python -m pytest tests -q -ra --durations=15 "$@"
