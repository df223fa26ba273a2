#!/usr/bin/env bash
# The main job: installs what it needs, then runs `megarl demo` (a tiny Megatron training run on
# CPU ranks). Extra arguments go to `megarl demo` (see `megarl demo --help`).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/ci/setup_env.sh"
cd "$ROOT"
exec "${MEGARL_VENV:-$ROOT/.venv}/bin/megarl" demo "$@"
