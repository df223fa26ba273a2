# The body of the RL job scripts (grpo_llama70b.sbatch, ppo_llama70b.sbatch, grpo_qwen3_moe.sbatch):
# sourced by them with SELF (the script), NAME, ROOT and DEFAULT_CONFIG set
# and the script's arguments; their headers document the knobs. --dry-run runs `megarl plan` and
# prints the commands; inside a Slurm job it checks the allocation, the time limit and the plan,
# then starts Ray on every node and `megarl train` (launch_scripts/ray_on_slurm.sh).
cd "$ROOT"
# The environment, as launch_scripts/ray_on_slurm.sh sets it up on every node: MEGARL_VENV (default
# the checkout's .venv) and/or the MEGARL_ACTIVATE command.
if [ -z "${MEGARL_VENV:-}${MEGARL_ACTIVATE:-}" ] && [ -d "$ROOT/.venv" ]; then export MEGARL_VENV=$ROOT/.venv; fi
if [ -n "${MEGARL_VENV:-}" ]; then export VIRTUAL_ENV=$MEGARL_VENV PATH="$MEGARL_VENV/bin:$PATH"; fi
eval "${MEGARL_ACTIVATE:-}"
CONFIG=${MEGARL_CONFIG:-$DEFAULT_CONFIG}
# The per-GPU memory budget: the config's cluster.gpu_memory_gib unless GPU_MEMORY_GIB overrides it.
BUDGET=() BUDGET_TEXT="the config's cluster.gpu_memory_gib"
if [ -n "${GPU_MEMORY_GIB:-}" ]; then BUDGET=(--gpu-memory-gib "$GPU_MEMORY_GIB") BUDGET_TEXT="$GPU_MEMORY_GIB GiB (GPU_MEMORY_GIB)"; fi
# The allocation: Slurm's when in a job, else this script's own #SBATCH defaults.
sbatch_default() { sed -n "s/^#SBATCH --$1=\([0-9]*\).*/\1/p" "$SELF" | head -1; }
NODES=${SLURM_JOB_NUM_NODES:-${MEGARL_NODES:-$(sbatch_default nodes)}}
GPUS=${SLURM_GPUS_PER_NODE:-${MEGARL_GPUS_PER_NODE:-$(sbatch_default gpus-per-node)}}
GPUS=${GPUS##*:}  # "h100:8" -> 8

OVERRIDES=("$@")
if [ -n "${MODEL_PATH:-}" ]; then OVERRIDES=("model.path=$MODEL_PATH" "${OVERRIDES[@]}"); fi
PLAN=(megarl plan "$CONFIG" "${OVERRIDES[@]}" "${BUDGET[@]}"
      --slurm-nodes "$NODES" --slurm-gpus-per-node "$GPUS")
TRAIN=(bash launch_scripts/ray_on_slurm.sh megarl train "$CONFIG" "${OVERRIDES[@]}")

if [ "$DRY_RUN" = 1 ]; then
  echo "== dry run: $NAME: $NODES nodes x $GPUS GPUs, per-GPU budget $BUDGET_TEXT"
  status=0
  "${PLAN[@]}" || status=$?
  echo "== the job would run (in $ROOT, on the first node of the allocation):"
  echo "  $(printf '%q ' "${PLAN[@]}") --check-files"
  echo "  $(printf '%q ' "${TRAIN[@]}")"
  echo "== submit with:"
  echo "  ${MODEL_PATH:+MODEL_PATH=$MODEL_PATH }${MEGARL_CONFIG:+MEGARL_CONFIG=$MEGARL_CONFIG }sbatch --nodes=$NODES --gpus-per-node=$GPUS $(printf '%q ' "launch_scripts/$NAME" "$@")"
  [ -n "${MODEL_PATH:-}" ] || echo "  (set MODEL_PATH=<HF checkpoint dir>: a real run refuses to start without it)"
  exit "$status"
fi

[ -n "${SLURM_JOB_ID:-}" ] || { echo "$NAME: not inside a Slurm job; submit it with sbatch, or use --dry-run" >&2; exit 2; }
[ -d "${MODEL_PATH:-}" ] || { echo "$NAME: MODEL_PATH=${MODEL_PATH:-} is not a directory; set it to the HF checkpoint of the policy" >&2; exit 2; }
# --signal=B:USR1@LEAD asks the job to checkpoint and requeue LEAD seconds before the limit: with
# less time than that left, USR1 would come at once, in every requeued run again.
LEAD=${MEGARL_SIGNAL_LEAD:-$(sed -n 's/^#SBATCH --signal=[^@]*@\([0-9]*\).*/\1/p' "$SELF" | head -1)}
left=$(squeue -h -j "$SLURM_JOB_ID" -o %L 2>/dev/null || true)
if [[ "$left" =~ ^(([0-9]+)-)?(([0-9]+):)?([0-9]+):([0-9]+)$ ]]; then
  left_s=$(( ${BASH_REMATCH[2]:-0} * 86400 + 10#${BASH_REMATCH[4]:-0} * 3600 + 10#${BASH_REMATCH[5]} * 60 + 10#${BASH_REMATCH[6]} ))
  if [ -n "$LEAD" ] && [ "$left_s" -le $(( LEAD + 60 )) ]; then
    echo "$NAME: the job has ${left} left, not more than the ${LEAD} s --signal lead (+60 s): USR1 would requeue it at once, again and again; submit with a longer --time (or a shorter --signal=B:USR1@N and MEGARL_SIGNAL_LEAD=N)" >&2
    exit 2
  fi
fi
status=0
"${PLAN[@]}" --check-files || status=$?
if [ "$status" = 2 ] || { [ "$status" = 1 ] && [ "${MEGARL_FORCE:-0}" != 1 ]; }; then
  echo "$NAME: the plan refused this run (exit $status); fix it (MEGARL_FORCE=1 launches a run that does not fit anyway)" >&2
  exit 2
fi
exec "${TRAIN[@]}"
