#!/usr/bin/env bash
# The README's test command: the whole suite on real components (local Ray, Delta, MLflow, Dagster).
#   bash scripts/test.sh            everything: what .ci/run and the README's command 2 run
#   bash scripts/test.sh --fast     the inner loop while editing: tests not marked slow, ray or cluster
#                                   (algorithms, stages, configs, pipelines without a training run)
# Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/e2e/test_rescore.py -k judge --durations=0`).
# Two xdist workers (RLAKE_TEST_WORKERS, 0 = in this process): a module stays on one worker, so its fixtures run
# once; modules that share a trained run train it once across workers (tests/shared_run.py). Costs: docs/testing.md.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_ACCEPT_CLOUD_SDK_WARNING=1 PYTHONUNBUFFERED=1
# torch's OpenMP threads sleep when idle instead of spinning: two pytest workers and their Ray workers share two
# cores, and a spinning thread takes CPU the other worker's processes are waiting for (docs/testing.md)
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
select=()
if [ "${1:-}" = "--fast" ]; then
  shift
  select=(-m "not slow and not ray and not cluster")
fi
exec python -m pytest -q -ra --durations=25 -n "${RLAKE_TEST_WORKERS:-2}" --dist loadfile "${select[@]}" "$@"
