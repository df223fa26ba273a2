#!/usr/bin/env bash
# Download the wheels ci/gpu_check.sh needs on a GPU machine that cannot reach a package index,
# into .gpu-wheels/ (git-ignored; copy it along with the checkout). The GPU machine brings its own
# CUDA PyTorch, transformers, numpy and packaging; megatron-core is the one missing piece.
#   bash ci/gpu_wheels.sh [PYTHON_VERSION]    # the GPU machine's Python, default 3.12
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-3.12}
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  -d .gpu-wheels megatron-core==0.16.1
ls -l .gpu-wheels
