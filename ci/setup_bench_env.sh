#!/usr/bin/env bash
# Create (or reuse) the benchmark environment of tools/bench_rl.py: torch 2.13.0 (CPU), the main
# environment's transformers, and TRL (the peer trainer), pinned in requirements/bench.txt.
# TRL lives only here, never in the package's environment. Re-running is cheap: nothing is
# installed when requirements/bench.txt is unchanged.
# MEGARL_BENCH_VENV picks another location (default: .venv-bench in the repository).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${MEGARL_BENCH_VENV:-$ROOT/.venv-bench}
STAMP=$VENV/.megarl-bench-installed
WANT=$(sha256sum < "$ROOT/requirements/bench.txt" | cut -d' ' -f1)
LABEL="megarl bench setup"
source "$ROOT/ci/venv_lib.sh"
venv_is_current && exit 0
venv_create
# torch first and pinned (bench.txt pins it too): an unpinned torch would pull a multi-GB CUDA build.
step "torch 2.13.0 (CPU wheel)"
pip_install torch==2.13.0
step "TRL and its needs (requirements/bench.txt)"
pip_install -r "$ROOT/requirements/bench.txt"
"$VENV/bin/python" - <<'PY'
import torch, transformers, trl
assert torch.__version__.startswith("2.13.0") and not torch.cuda.is_available() and torch.version.cuda is None, (
    f"bench env: expected the torch 2.13.0 CPU wheel, found {torch.__version__} (CUDA {torch.version.cuda})")
print(f"megarl bench setup: torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}")
PY
venv_done
