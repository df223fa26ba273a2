#!/usr/bin/env bash
# Create (or reuse) the benchmark environment of tools/bench_rl.py: torch 2.13.0 (CPU), the main
# environment's transformers, and TRL (the peer trainer), pinned in requirements/bench.txt.
# TRL lives only here, never in the package's environment. Re-running is cheap: nothing is
# installed when requirements/bench.txt is unchanged.
# MEGARL_BENCH_VENV picks another location (default: .venv-bench in the repository).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${MEGARL_BENCH_VENV:-$ROOT/.venv-bench}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
STAMP=$VENV/.megarl-bench-installed
WANT=$(sha256sum < "$ROOT/requirements/bench.txt" | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "megarl bench setup: Python >= 3.11 is required, $PYTHON is $("$PYTHON" --version 2>&1); set PYTHON=..." >&2; exit 2; }

step() { echo "megarl bench setup [$(date +%H:%M:%S)]: $*"; }
start=$(date +%s)
step "virtual environment at $VENV"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
pip_install() {  # pip, minus the noise of this machine's local-index settings; pip's status is kept
  "${PIP[@]}" "$@" 2>&1 | { grep -vE "is ignored: it is neither a file nor a directory" || true; }
}
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
echo "$WANT" > "$STAMP"
step "done in $(( $(date +%s) - start )) s"
