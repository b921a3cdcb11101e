#!/bin/bash
# On the GPU machine, in the repository root, with build_payload.sh's part00..part02 and protobuf wheel in
# /tmp/stage: unpack them over the image's packages (PYTHONPATH first) and run the device check. The image has
# no vLLM (its CUDA wheel is far over the 64 MiB a transfer carries, and pins torch 2.13 where the image has
# 2.11), so the GRPO iteration uses the HF engine on the GPU and the vLLM row is not run.
#   OUT=/tmp/out bash bench/device/run_check.sh
set -uo pipefail
mkdir -p /tmp/site "${OUT:?set OUT to the report folder}"
cat /tmp/stage/part0[0-2] | python3 -c "import lzma,sys,shutil; shutil.copyfileobj(lzma.open(sys.stdin.buffer), \
sys.stdout.buffer, 1 << 22)" | tar -x -C /tmp/site || { echo "unpacking the payload failed"; exit 3; }
python3 -m zipfile -e /tmp/stage/protobuf-*.whl /tmp/site
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import ray, dagster, deltalake, mlflow, megatron.core; print('imports ok')" || exit 3
timeout 480 python3 bench/gpu_check.py --out "$OUT/gpu_check.md" --sections rollout-hf grpo passes megatron \
  --grpo-rollout hf --budget-s 430 --workdir /tmp/gcw
rc=$?
tar czf "$OUT/logs.tgz" /tmp/gcw/*.log 2>/dev/null
exit $rc
