#!/usr/bin/env bash
# GPU acceptance check (tools/gpu_check.py): parity of Megatron's logits with HF transformers and
# bf16 training throughput of a ~1.1B Llama shape on one CUDA GPU; exits 1 on a failed check.
# Installs nothing from the network: wheels in .gpu-wheels/ (made by ci/gpu_wheels.sh on a machine
# with pip) go to a private directory; the machine's own CUDA PyTorch and transformers are used.
#   bash ci/gpu_check.sh [--json results.json]
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".gpu-wheels/*.whl" >/dev/null; then
  site=$(mktemp -d /tmp/megarl-gpu-site.XXXXXX)
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .gpu-wheels/*.whl
  export PYTHONPATH=$PYTHONPATH:$site
fi
export PYTHONUNBUFFERED=1
timeout 480 "$python" -m tools.gpu_check "$@"
