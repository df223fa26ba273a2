#!/usr/bin/env bash
# Stops the test cluster that ci/slurm_up.sh started: only the PIDs it recorded in
# $MEGARL_SLURM_DIR/pids (slurmd n1/n2, slurmctld, munged; SIGTERM, then SIGKILL after 10 s), and
# removes its /etc/hosts block. Kills nothing else. Idempotent: with nothing running it only says so.
# The state dir (logs) is kept for post-mortems; slurm_up.sh starts from a fresh one.
set -euo pipefail

DIR=${MEGARL_SLURM_DIR:-/tmp/megarl-slurm}
HOSTS_BEGIN="# BEGIN megarl-slurm test cluster (made by slurm_up.sh, removed by slurm_down.sh)"
HOSTS_END="# END megarl-slurm"
say() { echo "slurm_down: $*"; }
# One up/down at a time on this host (test sessions may start together).
if [ -z "${MEGARL_SLURM_LOCKED:-}" ]; then
  exec 9>"${DIR%/}.lock"
  flock -w 300 9 || { echo "${0##*/}: ERROR: ${DIR%/}.lock held for 300 s" >&2; exit 1; }
fi

# A recorded PID is only signalled if it still is the daemon that was started, with our state dir
# on its command line (PIDs get reused).
is_ours() {
  local name=$1 pid=$2 comm cmdline
  comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
  cmdline=$(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null) || return 1
  [[ $cmdline == *"$DIR/"* ]] || return 1
  case "$name" in
    munged) [[ $comm == munged ]] ;;
    slurmctld) [[ $comm == slurmctld ]] ;;
    slurmd-*) [[ $comm == slurmd ]] ;;
    *) return 1 ;;
  esac
}

if [ -f "$DIR/pids" ]; then
  # Reverse order: nodes first, then the controller, then munge.
  mapfile -t entries < <(tac "$DIR/pids")
  stopping=()
  for entry in "${entries[@]}"; do
    read -r name pid <<<"$entry"
    if is_ours "$name" "$pid"; then
      say "stopping $name (pid $pid)"
      kill -TERM "$pid" 2>/dev/null || true
      stopping+=("$name:$pid")
    else
      say "$name (pid $pid) is not running"
    fi
  done
  deadline=$((SECONDS + 10))
  for item in "${stopping[@]}"; do
    name=${item%%:*}; pid=${item##*:}
    while is_ours "$name" "$pid" && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
    if is_ours "$name" "$pid"; then
      say "$name (pid $pid) ignored SIGTERM: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  rm -f "$DIR/pids"
else
  say "no $DIR/pids: nothing of ours is running"
fi

if grep -qxF "$HOSTS_BEGIN" /etc/hosts 2>/dev/null; then
  tmp=$(mktemp)
  awk -v b="$HOSTS_BEGIN" -v e="$HOSTS_END" '$0 == b {skip = 1} !skip {print} $0 == e {skip = 0}' /etc/hosts > "$tmp" && cat "$tmp" > /etc/hosts
  rm -f "$tmp"
  say "removed the n1/n2 block from /etc/hosts"
fi
say "down"
