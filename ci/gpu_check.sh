#!/usr/bin/env bash
# One-GPU acceptance run (tools/gpu_check.py): environment report; the local spec's bf16 training
# throughput of a ~1.1B Llama shape and its logit parity with HF transformers; the RL worker's
# setup, forward, update, checkpoint round trip and HF export (tools/gpu_check_worker.py); then the same for
# Transformer Engine's spec (NVIDIA_TF32_OVERRIDE=0) where transformer_engine.pytorch imports.
# Each phase is written to the --json file as soon as it finishes, so a failed phase, a dead rank
# or this script's timeout loses none of the others; exits 1 on a failed phase, 124 on the timeout.
# Installs nothing from the network: wheels in .gpu-wheels/ (made by ci/gpu_wheels.sh on a machine
# with pip) go to a private directory behind the machine's own packages (its CUDA PyTorch first).
#   bash ci/gpu_check.sh [--json results.json]
#   GPU_CHECK_RANK_TIMEOUT_S=240: seconds for each of the three groups of phases (local, worker,
#   TE); the script's own timeout is all three plus 90 s for start-up and the environment report.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
rank_timeout=${GPU_CHECK_RANK_TIMEOUT_S:-240}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".gpu-wheels/*.whl" >/dev/null; then
  # Only the wheels whose package this Python lacks: the machine's own (CUDA PyTorch, and its
  # transformers where it has one) stay in charge, and nothing installs twice.
  mapfile -t wheels < <("$python" - .gpu-wheels/*.whl <<'PY'
import sys
from importlib import metadata
for path in sys.argv[1:]:
    try:
        metadata.version(path.rsplit("/", 1)[-1].split("-")[0])
    except metadata.PackageNotFoundError:
        print(path)
PY
)
  if ((${#wheels[@]})); then
    site=$(mktemp -d /tmp/megarl-gpu-site.XXXXXX)
    echo "gpu_check.sh: installing ${wheels[*]##*/} into $site"
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${wheels[@]}"
    export PYTHONPATH=$PYTHONPATH:$site
  fi
fi
export PYTHONUNBUFFERED=1
# SIGTERM first (gpu_check kills its ranks and records the timeout), SIGKILL 30 s later.
timeout --kill-after=30 $((3 * rank_timeout + 90)) "$python" -m tools.gpu_check --rank-timeout "$rank_timeout" "$@"
