#!/usr/bin/env bash
# Download the wheels ci/gpu_check.sh needs on a GPU machine that cannot reach a package index,
# into .gpu-wheels/ (git-ignored; copy it along with the checkout, about 39 MB). A machine that
# brings only CUDA PyTorch (and torch's own needs: filelock, fsspec, typing_extensions, jinja2,
# sympy, networkx) lacks megatron-core (+ numpy, packaging) for every phase and, for the parity
# phase, transformers with what it imports at run time: tokenizers and safetensors (abi3 wheels),
# huggingface_hub (httpx, httpcore, h11, anyio, idna, certifi), regex, pyyaml, tqdm. Not needed
# there (checked by importing the parity path with them absent): requests, hf-xet, typer, click,
# rich. ci/gpu_check.sh installs only the wheels whose package the machine lacks, so a machine
# with its own transformers keeps it. Versions: requirements/bench.txt's pins where it has one
# (numpy, transformers, tokenizers, safetensors, huggingface_hub), else the CPU venv's.
#   bash ci/gpu_wheels.sh [PYTHON_VERSION]    # the GPU machine's Python, default 3.12
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-3.12}
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu-wheels \
  megatron-core==0.16.1 numpy==2.4.6 packaging==26.4 \
  transformers==5.19.0 tokenizers==0.23.2 safetensors==0.8.0 huggingface_hub==1.33.0 \
  httpx==0.29.0 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 idna==3.21 certifi==2026.10.19.post1 \
  regex==2026.12.2 pyyaml==6.0.4 tqdm==4.70.1
ls -l .gpu-wheels
echo "total: $(du -ch .gpu-wheels/*.whl | tail -1 | cut -f1)"
