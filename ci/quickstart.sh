#!/usr/bin/env bash
# The main job: installs what it needs, makes the arithmetic prompts, then runs a tiny GRPO run on
# CPU (`megarl train configs/quickstart_grpo.yaml`) that ends by exporting the actor as an HF
# checkpoint. Extra arguments are config overrides, e.g. `bash ci/quickstart.sh trainer.total_steps=50`.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/ci/setup_env.sh"
cd "$ROOT"
VENV="${MEGARL_VENV:-$ROOT/.venv}"
if [ ! -f data/arith/train.parquet ]; then
  "$VENV/bin/python" tools/prepare_data.py synthetic-arith --output data/arith/train.parquet --num 2000 \
    --partial-credit-scale 5
fi
exec "$VENV/bin/megarl" train configs/quickstart_grpo.yaml "$@"
