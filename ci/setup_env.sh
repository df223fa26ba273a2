#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install the tested CPU stack into it.
# Re-running is cheap: nothing is installed when requirements/*.txt and setup.py are unchanged.
# MEGARL_VENV picks another location (default: .venv in the repository).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${MEGARL_VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
STAMP=$VENV/.megarl-installed
WANT=$(cat "$ROOT"/requirements/*.txt "$ROOT/setup.py" | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "megarl setup: Python >= 3.11 is required, $PYTHON is $("$PYTHON" --version 2>&1); set PYTHON=..." >&2; exit 2; }

step() { echo "megarl setup [$(date +%H:%M:%S)]: $*"; }
start=$(date +%s)
step "virtual environment at $VENV"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
pip_install() {  # pip, minus the noise of this machine's local-index settings; pip's status is kept
  "${PIP[@]}" "$@" 2>&1 | { grep -vE "is ignored: it is neither a file nor a directory|^sglang [0-9.]+ requires|dependency resolver does not currently" || true; }
}
# torch first and pinned: an unpinned torch anywhere later would pull a multi-GB CUDA build.
step "torch 2.13.0 (CPU wheel)"
pip_install torch==2.13.0
step "runtime stack (requirements/base.txt)"
pip_install -r "$ROOT/requirements/base.txt"
# sglang pins torch==2.14.1 and the CUDA stack (xgrammar pulls a 1 GB triton): --no-deps, then
# its pure-Python needs by name. parallel/cpu_stubs stands in for the CUDA-only modules.
step "sglang without its CUDA dependency tree"
pip_install --no-deps -r "$ROOT/requirements/sglang-nodeps.txt"
pip_install -r "$ROOT/requirements/sglang-deps.txt"
step "test tools and megarl itself (editable)"
pip_install -r "$ROOT/requirements/dev.txt"
pip_install --no-deps -e "$ROOT"
echo "$WANT" > "$STAMP"
step "done in $(( $(date +%s) - start )) s"
