#!/usr/bin/env bash
# The full test suite: installs what it needs (ci/setup_env.sh), then runs pytest.
# Extra arguments go to pytest (e.g. `bash ci/run_tests.sh -k megatron`).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/ci/setup_env.sh"
cd "$ROOT"
exec "${MEGARL_VENV:-$ROOT/.venv}/bin/python" -m pytest "$@"
