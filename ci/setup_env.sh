#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install the tested CPU stack into it.
# Re-running is cheap: nothing is installed when requirements/*.txt and setup.py are unchanged.
# MEGARL_VENV picks another location (default: .venv in the repository).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${MEGARL_VENV:-$ROOT/.venv}
STAMP=$VENV/.megarl-installed
WANT=$(cat "$ROOT"/requirements/*.txt "$ROOT/setup.py" | sha256sum | cut -d' ' -f1)
LABEL="megarl setup"
source "$ROOT/ci/venv_lib.sh"
venv_is_current && exit 0
venv_create
# torch first and pinned: an unpinned torch anywhere later would pull a multi-GB CUDA build.
step "torch 2.13.0 (CPU wheel)"
pip_install torch==2.13.0
step "runtime stack (requirements/base.txt)"
pip_install -r "$ROOT/requirements/base.txt"
# sglang pins torch==2.14.1 and the CUDA stack (xgrammar pulls a 1 GB triton): --no-deps, then
# its pure-Python needs by name. megarl/rollout/sglang/cpu/stubs.py stands in for the CUDA-only modules.
step "sglang without its CUDA dependency tree"
pip_install --no-deps -r "$ROOT/requirements/sglang-nodeps.txt"
pip_install -r "$ROOT/requirements/sglang-deps.txt"
step "test tools and megarl itself (editable)"
pip_install -r "$ROOT/requirements/dev.txt"
pip_install --no-deps -e "$ROOT"
venv_done
