#!/usr/bin/env bash
# Ray on Slurm: check the allocation, start one Ray node per Slurm node, run the driver on the
# head node, and leave nothing behind. Requeues itself when preempted (pre-timeout signal).
#
#   sbatch [--nodes=32 --gpus-per-node=8 --partition=P --account=A --time=24:00:00] \
#       launch_scripts/ray_on_slurm.sh megarl train configs/my_run.yaml cluster.nodes=32 ...
#
# The script's arguments are the driver command (run once, on the head node, with RAY_ADDRESS set).
# Every #SBATCH line below can be overridden on the sbatch command line.
#
#SBATCH --job-name=megarl
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
# Add as your cluster needs:  #SBATCH --gpus-per-node=8   #SBATCH --partition=...   #SBATCH --account=...
#
# --signal=B:USR1@300: Slurm sends USR1 to this batch shell (B:) 300 s before the time limit. The
#   script forwards SIGTERM to the driver (`megarl train` then saves a checkpoint and exits with
#   143), waits for it, tears Ray down and, unless the driver exited 0 (the run finished anyway),
#   runs `scontrol requeue`; the requeued job resumes from the newest checkpoint
#   (trainer.resume: auto). Allow enough seconds to finish a step and save.
# --requeue: the job may be requeued (Slurm itself also requeues it after a node failure).
#   Slurm's MaxBatchRequeue (default 5) bounds how often.
# --open-mode=append: a requeued run appends to the same log instead of truncating it.
# SIGTERM (scancel, or preemption with PreemptMode=REQUEUE/CANCEL): the driver is asked to save and
#   stop; the job then ends without requeueing itself (Slurm decides).
#
# Environment knobs (sbatch passes the submitting shell's environment to the job):
#   MEGARL_VENV=DIR            python venv to use (DIR/bin goes first on PATH) on every node
#   MEGARL_ACTIVATE='CMD'      shell command run before every command on every node instead
#                              (e.g. 'module load cuda/12.4; source /opt/env/bin/activate')
#   MEGARL_NET_IFACE=IFACE     network interface for Ray's node IPs and for NCCL/gloo sockets
#                              (NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME, unless set); default:
#                              on each node, the interface its route to the head's address (the
#                              head's name as another node resolves it) leaves through. A loopback
#                              address is refused on a multi-node job; set it where the host names
#                              resolve to a management network but the nodes share a faster one
#   NCCL_DEBUG=WARN            NCCL's log level on every node (INFO: its whole story)
#   RAY_PORT=6379              GCS port on the head node
#   MEGARL_RAY_NUM_CPUS=N      CPUs Ray offers per node (default: $SLURM_CPUS_ON_NODE); CPU-only
#                              runs: cluster.cpu_ranks_per_node
#   MEGARL_RAY_NUM_GPUS=N      GPUs Ray offers per node (default: Ray's own detection)
#   MEGARL_RAY_JOIN_TIMEOUT=300  seconds for all nodes to join Ray; a node that does not is named
#   MEGARL_PREFLIGHT=1         0 skips `megarl preflight` (hosts, GPUs, ulimits, /dev/shm, GPU health,
#                              all_reduce bandwidth within and across nodes, NCCL's transport;
#                              its floors: MEGARL_PREFLIGHT_INTRA_GBPS, _INTER_GBPS, _SHM_GIB, ...)
#   MEGARL_PREFLIGHT_TIMEOUT=120 seconds the preflight may take
#   MEGARL_PREFLIGHT_PORT=29555  its rendezvous port on the head node
#   MEGARL_GPUS_PER_NODE=N     GPUs each node must see (default: from --gpus-per-node, else unchecked)
#   MEGARL_DRIVER_GRACE=600    seconds the driver gets to checkpoint after SIGTERM before SIGKILL
#   MEGARL_MAX_REQUEUES=20     the script does not requeue a job already restarted this often
#   RAY_AUTH_MODE=token        Ray token authentication with a fresh per-job RAY_AUTH_TOKEN
#                              (set RAY_AUTH_TOKEN to choose it; RAY_AUTH_MODE=disabled: none)
#   MEGARL_RAY_STOP=0          1: also run `ray stop --force` on every node at the end. Off by default:
#                              the Ray steps are ended through Slurm, which ends every process they
#                              started; `ray stop` would also stop any other Ray of this user on the node.
#   MEGARL_CHECK_CONFIG=1      0 skips `megarl check-config` of a `megarl train ...` driver before
#                              anything starts (a bad config or override fails the job in seconds)
#   MEGARL_RAY_STOP_WAIT=30    seconds the Ray steps get to end through Slurm at teardown
#   MEGARL_NODE_CHECK_TIMEOUT=30 seconds one node check (srun --overlap, or MEGARL_NODE_SHELL) may take
#   MEGARL_NODE_SHELL='CMD {node}'  how to run a command on a node without Slurm, for the teardown
#                              check of a node Slurm cannot reach (its slurmd died): e.g.
#                              'ssh -o BatchMode=yes {node}'; the check script goes to its stdin
#                              (`CMD bash -s -- ARGS`). Default: none (such a node is reported as
#                              unverified and the job fails).
#
# On every node (and the batch node) the soft limits are raised: open files to 65535 and locked
# memory to the hard limit (NCCL over InfiniBand needs unlimited; a node where it is not, on a
# GPU job, is named). Ray's steps and the preflight get the node's CPUs (SLURM_JOB_CPUS_PER_NODE)
# and --gres=gpu:<GPUs per node> explicitly.
#
# Teardown is verified: every process a `ray start` step starts (raylet, GCS, agents, workers)
# carries MEGARL_RAY_STEP=<job id>:<node> in its environment and stays in the step's process group
# (recorded per node once Ray is up). After the Ray steps are ended through Slurm, a check on each
# node (srun --overlap; else MEGARL_NODE_SHELL) lists the live processes whose environment carries
# both that marker and this SLURM_JOB_ID, or that are in such a process's or a recorded process
# group, or descend from one, SIGTERMs/SIGKILLs exactly those, and reports per node what it
# stopped and what is left. A node left with such processes,
# or one that cannot be checked, is named and makes the job's exit status non-zero.
set -uo pipefail

log() { echo "[ray_on_slurm $(date +%H:%M:%S)] $*"; }
err() { echo "[ray_on_slurm $(date +%H:%M:%S)] ERROR: $*" >&2; }

if [ -z "${SLURM_JOB_ID:-}" ]; then
  err "not inside a Slurm allocation: submit with  sbatch launch_scripts/ray_on_slurm.sh <driver command...>"
  exit 2
fi
if [ $# -eq 0 ]; then
  err "no driver command: sbatch launch_scripts/ray_on_slurm.sh megarl train <config.yaml> [key=value ...]"
  exit 2
fi

export RAY_USAGE_STATS_ENABLED=0
# The driver has stopped before Ray is: no draining on SIGTERM (Ray would wait up to 30 s per node).
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}
RAY_PORT=${RAY_PORT:-6379}
JOIN_TIMEOUT=${MEGARL_RAY_JOIN_TIMEOUT:-300}
PREFLIGHT=${MEGARL_PREFLIGHT:-1}
PREFLIGHT_TIMEOUT=${MEGARL_PREFLIGHT_TIMEOUT:-120}
PREFLIGHT_PORT=${MEGARL_PREFLIGHT_PORT:-29555}
DRIVER_GRACE=${MEGARL_DRIVER_GRACE:-600}
export MEGARL_DRIVER_GRACE=$DRIVER_GRACE  # the driver warns when a step and a save would not fit in it
RAY_NUM_CPUS=${MEGARL_RAY_NUM_CPUS:-${SLURM_CPUS_ON_NODE:-}}
GPUS_PER_NODE=${MEGARL_GPUS_PER_NODE:-${SLURM_GPUS_PER_NODE:-}}
GPUS_PER_NODE=${GPUS_PER_NODE##*:}  # "h100:8" -> 8
RAY_STOP_WAIT=${MEGARL_RAY_STOP_WAIT:-30}
NODE_CHECK_TIMEOUT=${MEGARL_NODE_CHECK_TIMEOUT:-30}
NODE_STOP_GRACE=10  # seconds between SIGTERM and SIGKILL of leftover Ray processes on a node

if [ -n "${MEGARL_VENV:-}" ]; then
  export VIRTUAL_ENV=$MEGARL_VENV PATH="$MEGARL_VENV/bin:$PATH"
fi
export MEGARL_ACTIVATE=${MEGARL_ACTIVATE:-}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}  # NCCL's warnings reach the logs; INFO for its whole story

# Shell functions run on every node (and on the batch node); tests/launch_scripts/test_node_net.py
# runs them under bash. No single quotes inside: the block is one single-quoted string.
NODE_FUNCS='
raise_limits() {  # soft open files up to 65535 and soft locked memory up to the hard limits (Slurm
  local soft hard  # propagates the submitting shell soft limits, often 1024 and 64 KiB)
  soft=$(ulimit -Sn); hard=$(ulimit -Hn)
  if [ "$soft" != unlimited ] && [ "$soft" -lt 65535 ]; then
    if [ "$hard" = unlimited ] || [ "$hard" -ge 65535 ]; then ulimit -Sn 65535; else ulimit -Sn "$hard"; fi
  fi
  ulimit -Sl "$(ulimit -Hl)" 2>/dev/null || true
}
route_dev() {  # route_dev "$(ip -o route get ADDR)": the interface the route leaves through
  awk "{for (i = 1; i < NF; i++) if (\$i == \"dev\") {print \$(i + 1); exit}}" <<<"$1"
}
ip_int() {  # ip_int A.B.C.D: the address as one number
  local a b c d; IFS=. read -r a b c d <<<"$1"; echo $(((a << 24) + (b << 16) + (c << 8) + d))
}
pick_ipv4() {  # pick_ipv4 "CIDR..." "ADDR...": the first ADDR inside one of the CIDRs (this node name
  local cidr addr bits  # addresses), else the address of the first CIDR
  for addr in $2; do
    for cidr in $1; do
      bits=${cidr#*/}
      [ $(( ($(ip_int "$addr") ^ $(ip_int "${cidr%/*}")) >> (32 - bits) )) -eq 0 ] && { echo "$addr"; return; }
    done
  done
  set -- $1; [ -z "${1:-}" ] || echo "${1%/*}"
}
net_iface() {  # net_iface ADDR: the interface this node reaches ADDR through; for one of its own
  local route dev held  # addresses (a "local" route via lo), the interface that holds it
  route=$(ip -o route get "$1" 2>/dev/null) || return 1
  dev=$(route_dev "$route")
  if [[ $route == local* ]]; then
    held=$(ip -o -4 addr show | awk -v a="$1" "{split(\$4, p, \"/\"); if (p[1] == a) {print \$2; exit}}")
    [ -n "$held" ] && dev=$held
  fi
  echo "$dev"
}
node_net() {  # node_net HEAD_ADDR NODES: "NODE IFACE IP MEMLOCK SPEED_MBPS" of this node, or "NODE error WHY"
  local node=${SLURMD_NODENAME:-$(hostname -s)} iface ip speed
  if [ -n "${MEGARL_NET_IFACE:-}" ]; then
    iface=$MEGARL_NET_IFACE
    ip -o link show dev "$iface" >/dev/null 2>&1 || { echo "$node error MEGARL_NET_IFACE=$iface: no such interface here (ip -o link lists them)"; return; }
  else
    iface=$(net_iface "$1") || { echo "$node error no route to the head address $1; set MEGARL_NET_IFACE to the interface the nodes share"; return; }
  fi
  ip=$(pick_ipv4 "$(ip -o -4 addr show dev "$iface" | awk "{print \$4}")" "$(getent ahostsv4 "$(hostname)" | awk "{print \$1}")")
  [ -n "$ip" ] || { echo "$node error interface $iface has no IPv4 address; set MEGARL_NET_IFACE to one that has"; return; }
  if [ "$2" -gt 1 ] && [ -z "${MEGARL_NET_IFACE:-}" ] && [[ $ip == 127.* ]]; then
    echo "$node error the route to the head address $1 is the loopback interface $iface ($ip), which other nodes cannot reach; set MEGARL_NET_IFACE to the interface the nodes share (ib0, eth0, ...: ip -o -4 addr lists them)"; return
  fi
  speed=$(cat "/sys/class/net/$iface/speed" 2>/dev/null) || speed=?
  echo "$node $iface $ip $(ulimit -l) ${speed:-?}"
}
node_env() {  # limits, and NCCL/gloo on this node interface (MEGARL_NODE_IFACES "NODE=IFACE ..."), unless set
  local entry iface=""
  raise_limits
  for entry in ${MEGARL_NODE_IFACES:-}; do [ "${entry%%=*}" = "${SLURMD_NODENAME:-}" ] && iface=${entry#*=}; done
  [ -n "$iface" ] && export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$iface} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$iface}
  return 0
}
expand_counts() {  # expand_counts "72(x2),36" (SLURM_JOB_CPUS_PER_NODE): one count per node, "72 72 36"
  local part i out=()
  for part in ${1//,/ }; do
    if [[ $part =~ ^([0-9]+)\(x([0-9]+)\)$ ]]; then
      for ((i = 0; i < BASH_REMATCH[2]; i++)); do out+=("${BASH_REMATCH[1]}"); done
    else out+=("$part"); fi
  done
  echo "${out[*]}"
}
'
eval "$NODE_FUNCS"
raise_limits  # here too: srun passes this shell's limits on to the steps
# Every command on a node runs through this: limits and network variables, the activation command, then the command.
ON_NODE=(bash -c "$NODE_FUNCS"'node_env; eval "$MEGARL_ACTIVATE" || { echo "MEGARL_ACTIVATE failed on $(hostname)" >&2; exit 3; }; exec "$@"' on-node)
# The driver runs through this wrapper: Slurm delivers a forwarded signal to every process of the
# step, so the driver starts with USR2 ignored, and the wrapper turns USR2 into SIGTERM for it.
DRIVER_TASK=(bash -c "$NODE_FUNCS"'node_env; eval "$MEGARL_ACTIVATE" || exit 3; trap "" USR2; "$@" & child=$!
  trap "kill -TERM $child 2>/dev/null" USR2
  while :; do wait "$child"; rc=$?; kill -0 "$child" 2>/dev/null || exit "$rc"; done' driver)
eval "$MEGARL_ACTIVATE" || { err "MEGARL_ACTIVATE failed on the batch node $(hostname)"; exit 3; }

# The per-node check of the teardown (and of the start-up record), run on a node by
# `bash -c "$NODE_CHECK" node-check JOB NODE MODE GRACE GROUPS` (srun) or `bash -s -- JOB NODE MODE GRACE GROUPS`
# (MEGARL_NODE_SHELL). It only reads /proc and signals the processes whose environment carries both
# SLURM_JOB_ID=JOB and MEGARL_RAY_STEP=JOB:NODE (what this job's `ray start` step on NODE started),
# the other members of their process groups and of the groups recorded at start (GROUPS,
# "NODE:PGID,PGID ..."; Ray's agents overwrite their environment with their process title), and
# their descendants; nothing else is touched. Prints "NODE found|stopped|left PID NAME", "NODE clean", then "NODE done".
#   MODE list: the processes found;  MODE stop: SIGTERM them, SIGKILL what is left after GRACE s.
NODE_CHECK='
job=$1 node=$2 mode=$3 grace=${4:-10}
[ "$node" = - ] && node=${SLURMD_NODENAME:-$(hostname -s)}
groups=""  # process groups recorded at start (list mode prints them as "NODE group PGID"); $5: "NODE:PGID,PGID ..."
for entry in ${5:-}; do [ "${entry%%:*}" = "$node" ] && groups=${entry#*:}; done
procs() {  # the marked processes, the rest of their process groups and of the recorded ones, and their descendants
  local files marked
  files=$(grep -lszxF -e "MEGARL_RAY_STEP=$job:$node" /proc/[0-9]*/environ)  # (status 2: unreadable files)
  [ -n "$files" ] && marked=$(grep -lszxF -e "SLURM_JOB_ID=$job" $files | cut -d/ -f3 | tr "\n" " ")
  cat /proc/[0-9]*/stat 2>/dev/null | awk -v marked="${marked:-}" -v groups="$groups" -v self=$$ "$SELECT"
}
# Over /proc/*/stat ("pid (comm) state ppid pgrp ..."): a process group outlives its leader and its
# id is not reused while it has members, so a recorded one still names only processes of this step
# (e.g. agents whose title overwrote their environment, orphaned when raylet was killed).
SELECT='"'"'
  { pid = $1; sub(/^.*\) /, ""); if ($1 == "Z" || pid == self) next; ppid[pid] = $2; pgrp[pid] = $3 }
  END {
    n = split(marked, m, " "); for (i = 1; i <= n; i++) if (m[i] in ppid) { sel[m[i]] = 1; grp[pgrp[m[i]]] = 1 }
    n = split(groups, g, ","); for (i = 1; i <= n; i++) if (g[i] != "") grp[g[i]] = 1
    for (p in ppid) if (pgrp[p] in grp) sel[p] = 1
    do { more = 0; for (p in ppid) if (!(p in sel) && (ppid[p] in sel)) { sel[p] = 1; more = 1 } } while (more)
    for (p in sel) print p
  }'"'"'
name() {
  local w=()
  read -r -a w < <(tr "\0" " " < "/proc/$1/cmdline" 2>/dev/null | cut -c1-300) || true
  case "${w[0]##*/}" in
    python*|bash|sh)  # the script (or module) it runs, not the interpreter
      local i=1
      while [[ ${w[i]:-} == -* && ${w[i]} != -m ]]; do i=$((i + 1)); done
      [ "${w[i]:-}" = -m ] && i=$((i + 1))
      [ -n "${w[i]:-}" ] && w=("${w[@]:i}") ;;
  esac
  local word=${w[0]:-?}
  case "$word" in
    */ray) echo "ray ${w[1]:-}" ;;
    */*.py) local dir=${word%/*}; echo "${dir##*/}/${word##*/}" ;;
    *) echo "${word##*/}" ;;
  esac
}
declare -A NAME=()
found=($(procs | sort -n))
for pid in "${found[@]}"; do NAME[$pid]=$(name "$pid"); done
if [ "$mode" = list ] || [ ${#found[@]} -eq 0 ]; then
  for pid in "${found[@]}"; do echo "$node found $pid ${NAME[$pid]}"; done
  [ "$mode" = list ] && for pid in "${found[@]}"; do sed "s/^.*) //" "/proc/$pid/stat" | awk -v n="$node" "{print n, \"group\", \$3}"; done | sort -u
  [ ${#found[@]} -eq 0 ] && echo "$node clean"
  echo "$node done"; exit 0
fi
now=($(procs))  # found again just before the signal: only processes that still carry the marker
[ ${#now[@]} -gt 0 ] && kill -TERM "${now[@]}" 2>/dev/null
end=$((SECONDS + grace))
while [ -n "$(procs)" ] && [ $SECONDS -lt $end ]; do sleep 0.5; done
rest=($(procs))
[ ${#rest[@]} -gt 0 ] && kill -KILL "${rest[@]}" 2>/dev/null
end=$((SECONDS + 5))
while [ -n "$(procs)" ] && [ $SECONDS -lt $end ]; do sleep 0.5; done
declare -A LEFT=()
for pid in $(procs); do LEFT[$pid]=1; [ -n "${NAME[$pid]:-}" ] || NAME[$pid]=$(name "$pid"); done
for pid in "${found[@]}"; do [ -z "${LEFT[$pid]:-}" ] && echo "$node stopped $pid ${NAME[$pid]}"; done
for pid in "${!LEFT[@]}"; do echo "$node left $pid ${NAME[$pid]}"; done
echo "$node done"
'

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
N=${#NODES[@]}
HEAD=${NODES[0]}
log "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $N node(s): ${NODES[*]}; head $HEAD"

# ---------------------------------------------------------------- teardown on every exit path
declare -A RAY_SRUN=()   # node -> pid of its `srun ... ray start --block`
DRIVER_PID=""
PREEMPTED=0          # USR1 (pre-timeout) arrived
PREEMPTED_DURING_RUN=0
TERMINATED=0
CLEANED=0

alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }

wait_gone() {  # wait_gone SECONDS PID... : until all exited or the time is up
  local until=$((SECONDS + $1)); shift
  local pid
  for pid in "$@"; do
    while alive "$pid" && [ $SECONDS -lt $until ]; do sleep 0.5; done
  done
}

# SIGTERM to the driver process itself. Not to its srun: srun answers SIGTERM by ending the whole
# step (SIGKILL KillWait seconds later, too soon for a checkpoint). srun forwards SIGUSR2 as it
# is, and the driver's wrapper (DRIVER_TASK) turns it into SIGTERM for the driver.
signal_driver() {
  alive "$DRIVER_PID" || return 0
  kill -USR2 "$DRIVER_PID" 2>/dev/null && log "sent SIGTERM to the driver"
}

stop_driver() {
  alive "$DRIVER_PID" || return 0
  log "asking the driver to checkpoint and stop (SIGTERM; up to ${DRIVER_GRACE}s)"
  signal_driver
  wait_gone "$DRIVER_GRACE" "$DRIVER_PID"
  if alive "$DRIVER_PID"; then
    log "the driver did not stop within ${DRIVER_GRACE}s: ending its step"
    kill -TERM "$DRIVER_PID" 2>/dev/null
    wait_gone 30 "$DRIVER_PID"
    alive "$DRIVER_PID" && kill -KILL "$DRIVER_PID" 2>/dev/null
  fi
}

# node_checks MODE NODE...: runs NODE_CHECK on each node, through one srun step over all of them,
# then one srun per node that did not answer, then MEGARL_NODE_SHELL for the ones still silent.
# Fills CHECK_LINES[node] (its report lines), CHECK_VIA[node] (srun | node shell; empty: not
# reached) and CHECK_WHY[node] (why it was not reached).
declare -A CHECK_LINES=() CHECK_VIA=() CHECK_WHY=()
node_checks() {
  local mode=$1; shift
  local nodes=("$@") node tmp pids=() missing=() limit=$((NODE_CHECK_TIMEOUT + NODE_STOP_GRACE + 5))
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/megarl-check-$SLURM_JOB_ID.XXXXXX")
  CHECK_LINES=(); CHECK_VIA=(); CHECK_WHY=()
  local groups=""  # "NODE:PGID,PGID ..." of the start-up record
  for node in "${nodes[@]}"; do [ -n "${START_GROUPS[$node]:-}" ] && groups+="$node:${START_GROUPS[$node]} "; done
  answered() { grep -q "^$1 done\$" "$2" 2>/dev/null; }
  timeout -k 5 "$limit" srun --overlap --nodes=${#nodes[@]} --ntasks-per-node=1 -w "$(IFS=,; echo "${nodes[*]}")" \
    --kill-on-bad-exit=0 bash -c "$NODE_CHECK" node-check "$SLURM_JOB_ID" - "$mode" "$NODE_STOP_GRACE" "$groups" \
    >"$tmp/all" 2>"$tmp/all.err" </dev/null
  local still=() failed
  for node in "${nodes[@]}"; do
    if answered "$node" "$tmp/all"; then
      CHECK_VIA[$node]=srun; CHECK_LINES[$node]=$(grep "^$node " "$tmp/all")
    elif failed=$(grep -m1 "failed on node $node:" "$tmp/all.err"); then
      CHECK_WHY[$node]="srun cannot reach it (${failed#srun: error: })"  # no second try
      still+=("$node")
    else
      missing+=("$node")
    fi
  done
  for node in "${missing[@]}"; do  # a second try, one step per node
    timeout -k 5 "$limit" srun --overlap --nodes=1 --ntasks=1 -w "$node" --kill-on-bad-exit=0 \
      bash -c "$NODE_CHECK" node-check "$SLURM_JOB_ID" "$node" "$mode" "$NODE_STOP_GRACE" "$groups" \
      >"$tmp/$node.srun" 2>"$tmp/$node.srun.err" </dev/null &
    pids+=($!)
  done
  [ ${#pids[@]} -gt 0 ] && wait "${pids[@]}" 2>/dev/null
  for node in "${missing[@]}"; do
    if answered "$node" "$tmp/$node.srun"; then
      CHECK_VIA[$node]=srun; CHECK_LINES[$node]=$(grep "^$node " "$tmp/$node.srun")
    else
      failed=$(grep -m1 "error:" "$tmp/$node.srun.err" || grep -v '^ *$' "$tmp/$node.srun.err" | tail -n 1)
      CHECK_WHY[$node]="srun cannot reach it (${failed:-no answer within ${limit}s})"
      still+=("$node")
    fi
  done
  [ ${#still[@]} -eq 0 ] && { rm -rf "$tmp"; return 0; }
  if [ ${#still[@]} -gt 0 ] && [ -n "${MEGARL_NODE_SHELL:-}" ]; then
    pids=()
    for node in "${still[@]}"; do
      local shell=()
      read -r -a shell <<<"${MEGARL_NODE_SHELL//\{node\}/$node}"
      timeout -k 5 "$limit" "${shell[@]}" bash -s -- "$SLURM_JOB_ID" "$node" "$mode" "$NODE_STOP_GRACE" "$node:${START_GROUPS[$node]:-}" \
        <<<"$NODE_CHECK" >"$tmp/$node.shell" 2>"$tmp/$node.shell.err" &
      pids+=($!)
    done
    wait "${pids[@]}" 2>/dev/null
    for node in "${still[@]}"; do
      if answered "$node" "$tmp/$node.shell"; then
        CHECK_VIA[$node]="MEGARL_NODE_SHELL"; CHECK_LINES[$node]=$(grep "^$node " "$tmp/$node.shell")
      else
        CHECK_WHY[$node]+="; MEGARL_NODE_SHELL failed: $(grep -v '^ *$' "$tmp/$node.shell.err" | tail -n 1 | cut -c1-200)"
      fi
    done
  elif [ ${#still[@]} -gt 0 ]; then
    for node in "${still[@]}"; do CHECK_WHY[$node]+="; no MEGARL_NODE_SHELL to reach it otherwise"; done
  fi
  rm -rf "$tmp"
}

# "PID NAME, PID NAME" of a node's report lines of one kind (found, stopped, left).
procs_of() { awk -v k="$2" '$2 == k {$1 = $2 = ""; sub(/^ +/, ""); printf "%s%s", sep, $0; sep = ", "}' <<<"${CHECK_LINES[$1]:-}"; }

declare -A START_PROCS=() START_GROUPS=()  # node -> its Ray processes / their process groups, once all joined
TEARDOWN_FAILED=0
# After the Ray steps were ended through Slurm: check every node that ran one, stop what is left
# there (by the job's marker only), and report per node. Sets TEARDOWN_FAILED when something may remain.
verify_ray_stopped() {
  local nodes=() node clean=() bad=() stopped left
  for node in "${NODES[@]}"; do [ -n "${RAY_SRUN[$node]:-}" ] && nodes+=("$node"); done
  node_checks stop "${nodes[@]}"
  for node in "${nodes[@]}"; do
    if [ -z "${CHECK_VIA[$node]:-}" ]; then
      err "$node: cannot verify that this job's Ray processes ended there: ${CHECK_WHY[$node]}." \
        "Ray processes recorded there at start: ${START_PROCS[$node]:-none recorded}; they may still be running"
      bad+=("$node"); continue
    fi
    stopped=$(procs_of "$node" stopped); left=$(procs_of "$node" left)
    [ -n "$stopped" ] && log "$node: Slurm did not end this job's Ray there; stopped (via ${CHECK_VIA[$node]}): $stopped"
    if [ -n "$left" ]; then
      err "$node: Ray processes of this job still running after SIGTERM and SIGKILL (via ${CHECK_VIA[$node]}): $left"
      bad+=("$node")
    else
      clean+=("$node")
    fi
  done
  if [ ${#bad[@]} -gt 0 ]; then
    TEARDOWN_FAILED=1
    err "teardown: Ray processes of job $SLURM_JOB_ID may be left on ${bad[*]} (see above)${clean[*]:+; none left on ${clean[*]}}"
  else
    log "Ray is down: no Ray process of job $SLURM_JOB_ID left on ${clean[*]}"
  fi
}

cleanup() {
  [ "$CLEANED" = 1 ] && return 0
  CLEANED=1
  trap '' TERM USR1 INT
  stop_driver
  local pids=() node
  for node in "${!RAY_SRUN[@]}"; do alive "${RAY_SRUN[$node]}" && pids+=("${RAY_SRUN[$node]}"); done
  if [ ${#pids[@]} -gt 0 ]; then
    local ray_nodes=()
    for node in "${NODES[@]}"; do [ -n "${RAY_SRUN[$node]:-}" ] && ray_nodes+=("$node"); done
    log "stopping Ray on ${ray_nodes[*]}"
    # SIGTERM to an srun ends its job step: Slurm stops `ray start --block` and every process it
    # started (raylet, GCS, workers), on that node - if it can reach the node (verified below).
    kill -TERM "${pids[@]}" 2>/dev/null
    wait_gone "$RAY_STOP_WAIT" "${pids[@]}"
    for node in "${ray_nodes[@]}"; do
      alive "${RAY_SRUN[$node]}" || continue
      log "$node: its Ray step did not end through Slurm within ${RAY_STOP_WAIT}s (MEGARL_RAY_STOP_WAIT): killing its srun"
      kill -KILL "${RAY_SRUN[$node]}" 2>/dev/null
      { wait "${RAY_SRUN[$node]}"; } 2>/dev/null  # (no "Killed" notice from bash)
    done
  fi
  if [ "${MEGARL_RAY_STOP:-0}" = 1 ] && [ ${#RAY_SRUN[@]} -gt 0 ]; then
    timeout 60 srun --overlap --nodes="$N" --ntasks-per-node=1 "${ON_NODE[@]}" ray stop --force >/dev/null 2>&1 || true
  fi
  [ ${#RAY_SRUN[@]} -gt 0 ] && verify_ray_stopped
  local rest
  rest=$(jobs -pr)
  [ -n "$rest" ] && kill -KILL $rest 2>/dev/null
  wait 2>/dev/null
}
on_exit() {
  local rc=$?
  cleanup
  [ "$TEARDOWN_FAILED" = 1 ] && [ "$rc" -eq 0 ] && rc=1
  log "exit status $rc"
  exit "$rc"
}
trap on_exit EXIT
on_usr1() {
  PREEMPTED=1
  alive "$DRIVER_PID" && PREEMPTED_DURING_RUN=1
  log "USR1: the allocation ends soon: checkpoint, stop, requeue"
  signal_driver
}
on_term() {
  TERMINATED=1
  log "$1: stopping (the driver saves a checkpoint first)"
  signal_driver
}
trap on_usr1 USR1
trap 'on_term SIGTERM' TERM
trap 'on_term SIGINT' INT

fail() { err "$*"; exit 1; }
requeue_and_exit() {
  cleanup
  if [ "${SLURM_RESTART_COUNT:-0}" -ge "${MEGARL_MAX_REQUEUES:-20}" ]; then
    err "already requeued ${SLURM_RESTART_COUNT} times (MEGARL_MAX_REQUEUES): not again"; exit 1
  fi
  log "requeueing job $SLURM_JOB_ID: $1"
  scontrol requeue "$SLURM_JOB_ID" || { err "scontrol requeue $SLURM_JOB_ID failed (submitted with --no-requeue?)"; exit 1; }
  sleep 30  # Slurm ends this run of the job now
  exit 0
}
# Runs "$@" in the background and waits for it so that the traps fire meanwhile; returns its status.
run_bg_wait() {
  "$@" &
  local pid=$! rc
  while :; do
    wait "$pid"; rc=$?
    alive "$pid" || break
  done
  if [ "$rc" -gt 128 ]; then wait "$pid" 2>/dev/null; local again=$?; [ "$again" != 127 ] && rc=$again; fi
  return "$rc"
}
check_stop() {  # after a signal during bring-up: nothing ran yet, so requeue (USR1) or stop
  [ "$PREEMPTED" = 1 ] && requeue_and_exit "preempted during bring-up"
  [ "$TERMINATED" = 1 ] && exit 143
  return 0
}

# ---------------------------------------------------------------- the driver's config
# `megarl train <config> [overrides]`: validated here first (its data files too), so a wrong
# config or override fails the job in seconds, before the preflight and Ray.
if [ "${MEGARL_CHECK_CONFIG:-1}" = 1 ] && [ "${1:-}" = megarl ] && [ "${2:-}" = train ]; then
  check_args=()
  for arg in "${@:3}"; do [ "$arg" = --no-export ] || check_args+=("$arg"); done
  log "checking the config: megarl check-config ${check_args[*]}"
  run_bg_wait timeout --kill-after=10 120 megarl check-config "${check_args[@]}" >/dev/null
  rc=$?
  check_stop
  [ $rc -eq 0 ] || { err "the driver's config is invalid (megarl check-config: status $rc; the config errors are above): nothing started"; exit 2; }
fi

# ---------------------------------------------------------------- addresses
# The head's address as the other nodes resolve its name (a head's own /etc/hosts may map it to
# 127.0.1.1); each node then takes the interface its route to that address leaves through, or
# MEGARL_NET_IFACE, and its IPv4 there (node_net). Ray, gloo and NCCL's sockets all use that interface.
HEAD_ADDR=-
if [ -z "${MEGARL_NET_IFACE:-}" ]; then
  resolver=${NODES[1]:-$HEAD}
  HEAD_ADDR=$(timeout 60 srun --overlap --nodes=1 --ntasks=1 -w "$resolver" "${ON_NODE[@]}" getent ahostsv4 "$HEAD" \
    | awk -v n="$N" '$1 !~ /^127\./ || n == 1 {print $1; exit}')
  [ -n "$HEAD_ADDR" ] || [ "$N" -gt 1 ] || HEAD_ADDR=127.0.0.1
  [ -n "$HEAD_ADDR" ] || fail "the head node's name $HEAD resolves to no address but loopback on $resolver" \
    "(getent ahostsv4 $HEAD): set MEGARL_NET_IFACE to the interface the nodes share (ib0, eth0, ...)"
fi
declare -A IP_OF=() IFACE_OF=()
while read -r host iface ip memlock speed; do
  if [ "$iface" = error ]; then fail "node $host: $ip $memlock $speed"; fi
  IFACE_OF[$host]=$iface IP_OF[$host]=$ip
  if [ "${GPUS_PER_NODE:-0}" -gt 0 ] 2>/dev/null && [ "$memlock" != unlimited ]; then
    log "WARNING: $host: ulimit -l (locked memory) is $memlock KiB even after raising it to the hard limit;" \
      "NCCL over InfiniBand/RoCE needs unlimited (the preflight fails it on a multi-node GPU job)"
  fi
  if [ "$N" -gt 1 ] && [[ $speed =~ ^[0-9]+$ ]] && [ "$speed" -gt 0 ] && [ "$speed" -lt 10000 ]; then
    log "WARNING: $host: $iface links at $speed Mb/s: Ray, gloo and the torch.distributed rendezvous run over it;" \
      "set MEGARL_NET_IFACE to the fabric's interface (e.g. ib0) if the nodes have one"
  fi
done < <(timeout 60 srun --overlap --nodes="$N" --ntasks-per-node=1 "${ON_NODE[@]}" bash -c "$NODE_FUNCS"'node_net "$@"' \
  node-net "$HEAD_ADDR" "$N")
for node in "${NODES[@]}"; do
  [ -n "${IP_OF[$node]:-}" ] || fail "node $node did not report its IP (srun to it failed or hung)"
done
HEAD_IP=${IP_OF[$HEAD]}
export MEGARL_NODE_IFACES=$(for n in "${NODES[@]}"; do printf '%s=%s ' "$n" "${IFACE_OF[$n]}"; done)
log "head $HEAD at $HEAD_IP; node IPs: $(for n in "${NODES[@]}"; do printf '%s=%s(%s) ' "$n" "${IP_OF[$n]}" "${IFACE_OF[$n]}"; done)"
# What each step gets, explicitly (not what SLURM_* variables a step inherits say): every CPU of
# the node (Ray's steps and the preflight) and the job's GPUs per node.
declare -A CPUS_OF=()
read -r -a cpus <<<"$(expand_counts "${SLURM_JOB_CPUS_PER_NODE:-}")"
for i in "${!NODES[@]}"; do CPUS_OF[${NODES[$i]}]=${cpus[$i]:-}; done
step_resources() {  # step_resources NODE...: srun options for a step on these nodes (the fewest CPUs of them)
  local node least=""
  for node in "$@"; do [ -n "${CPUS_OF[$node]}" ] && { [ -z "$least" ] || [ "${CPUS_OF[$node]}" -lt "$least" ]; } && least=${CPUS_OF[$node]}; done
  [ -n "$least" ] && echo "--cpus-per-task=$least"
  [ "${GPUS_PER_NODE:-0}" -gt 0 ] 2>/dev/null && echo "--gres=gpu:$GPUS_PER_NODE"
  return 0
}
check_stop

# ---------------------------------------------------------------- preflight
if [ "$PREFLIGHT" = 1 ]; then
  log "preflight on ${NODES[*]} (timeout ${PREFLIGHT_TIMEOUT}s)"
  gpu_arg=(); [ -n "$GPUS_PER_NODE" ] && gpu_arg=(--gpus-per-node "$GPUS_PER_NODE")
  mapfile -t resources < <(step_resources "${NODES[@]}")
  run_bg_wait timeout --kill-after=10 $((PREFLIGHT_TIMEOUT + 30)) srun --overlap --nodes="$N" --ntasks-per-node=1 \
    "${resources[@]}" --kill-on-bad-exit=0 "${ON_NODE[@]}" megarl preflight --master-addr "$HEAD_IP" \
    --master-port "$PREFLIGHT_PORT" --hosts "$(IFS=,; echo "${NODES[*]}")" "${gpu_arg[@]}" --timeout "$PREFLIGHT_TIMEOUT"
  rc=$?
  check_stop
  [ $rc -eq 0 ] || fail "preflight failed (status $rc): see the preflight ERROR lines above for the node(s)"
fi

# ---------------------------------------------------------------- Ray head, then workers
# Ray's token authentication with a fresh token per job, passed to every node and the driver in
# the environment (no shared ~/.ray needed). RAY_AUTH_MODE=disabled opts out; a given
# RAY_AUTH_TOKEN is used as it is.
if [ "${RAY_AUTH_MODE:-token}" = token ]; then
  export RAY_AUTH_MODE=token
  [ -n "${RAY_AUTH_TOKEN:-}" ] || export RAY_AUTH_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
fi
# No log monitor (a Python process per node that tails every worker's log files and publishes them
# through the GCS to every driver; megarl's driver does not read them: log_to_driver=False) and,
# on the head, no autoscaler monitor (a Slurm allocation does not scale): ~0.05 GB each, and no
# GCS fan-out of worker logs, which grows with the cluster.
ray_args=(--block --disable-usage-stats --include-log-monitor=false)
[ -n "$RAY_NUM_CPUS" ] && ray_args+=(--num-cpus="$RAY_NUM_CPUS")
[ -n "${MEGARL_RAY_NUM_GPUS:-}" ] && ray_args+=(--num-gpus="$MEGARL_RAY_NUM_GPUS")
start_ray_on() {  # start_ray_on NODE ARGS...: `ray start --block` as a background job step
  local node=$1 resources; shift
  mapfile -t resources < <(step_resources "$node")
  # MEGARL_RAY_STEP marks every process this step starts (inherited by raylet, GCS, agents and
  # workers): the teardown finds exactly those on the node by it.
  srun --overlap --nodes=1 --ntasks=1 -w "$node" "${resources[@]}" --kill-on-bad-exit=1 "${ON_NODE[@]}" \
    env "MEGARL_RAY_STEP=$SLURM_JOB_ID:$node" ray start --node-ip-address="${IP_OF[$node]}" "${ray_args[@]}" "$@" > >(sed -u "s/^/[ray $node] /") 2>&1 &
  RAY_SRUN[$node]=$!
}
log "starting the Ray head on $HEAD ($HEAD_IP:$RAY_PORT)"
start_ray_on "$HEAD" --head --port="$RAY_PORT" --include-dashboard=false --no-monitor
export RAY_ADDRESS="$HEAD_IP:$RAY_PORT"

# Alive Ray nodes' IPs, straight from the GCS (no dashboard needed); empty while it is not up.
ray_node_ips() {
  timeout 30 python - "$RAY_ADDRESS" <<'EOF' 2>/dev/null
import sys
from ray._raylet import GcsClient
try:
    nodes = GcsClient(address=sys.argv[1]).get_all_node_info(timeout=5)
except Exception:
    sys.exit(0)
for info in nodes.values():
    if info.state == 0:  # ALIVE
        print(info.node_manager_address)
EOF
}

deadline=$((SECONDS + JOIN_TIMEOUT))
started_workers=0
while :; do
  check_stop
  for node in "${!RAY_SRUN[@]}"; do
    if ! alive "${RAY_SRUN[$node]}"; then
      wait "${RAY_SRUN[$node]}"; rc=$?
      fail "Ray on node $node (${IP_OF[$node]}) exited during start-up with status $rc; its output above is prefixed [ray $node]"
    fi
  done
  mapfile -t joined < <(ray_node_ips)
  if [ "$started_workers" = 0 ] && [ ${#joined[@]} -ge 1 ]; then
    for node in "${NODES[@]:1}"; do start_ray_on "$node" --address="$RAY_ADDRESS"; done
    started_workers=1
    log "head is up; starting Ray workers on ${NODES[*]:1}"
  fi
  missing=()
  for node in "${NODES[@]}"; do
    printf '%s\n' "${joined[@]}" | grep -qxF "${IP_OF[$node]}" || missing+=("$node")
  done
  [ ${#missing[@]} -eq 0 ] && break
  if [ $SECONDS -ge $deadline ]; then
    fail "Ray nodes not joined after ${JOIN_TIMEOUT}s (MEGARL_RAY_JOIN_TIMEOUT): ${missing[*]} (joined: ${joined[*]:-none})"
  fi
  sleep 2
done
log "all $N Ray nodes joined: RAY_ADDRESS=$RAY_ADDRESS"
# The start-up record: each node's Ray processes (by the job's marker), named at teardown for a
# node that cannot be checked then.
node_checks list "${NODES[@]}"
for node in "${NODES[@]}"; do
  START_PROCS[$node]=$(procs_of "$node" found)
  START_GROUPS[$node]=$(awk '$2 == "group" {printf "%s%s", sep, $3; sep = ","}' <<<"${CHECK_LINES[$node]:-}")
  if [ -z "${CHECK_VIA[$node]:-}" ]; then
    log "WARNING: could not list the Ray processes on $node (${CHECK_WHY[$node]})"
  elif [ -z "${START_PROCS[$node]}" ]; then
    log "WARNING: no process carrying MEGARL_RAY_STEP=$SLURM_JOB_ID:$node found on $node: its teardown check will see nothing"
  else
    log "Ray processes on $node: ${START_PROCS[$node]}"
  fi
done

# ---------------------------------------------------------------- the driver
log "driver on $HEAD: $*"
srun --overlap --nodes=1 --ntasks=1 -w "$HEAD" --job-name=megarl-driver --kill-on-bad-exit=1 "${DRIVER_TASK[@]}" "$@" &
DRIVER_PID=$!
# Wait for the driver, and meanwhile for any Ray node's step to end: a node lost mid-run is named,
# and the driver is asked to checkpoint and stop instead of waiting on a dead node.
watch=("$DRIVER_PID" "${RAY_SRUN[@]}")
LOST=()
while :; do
  done_pid=""
  wait -n -p done_pid "${watch[@]}"; status=$?
  if [ -z "${done_pid:-}" ]; then  # a trap interrupted the wait (bash then unsets done_pid)
    alive "$DRIVER_PID" && continue
    wait "$DRIVER_PID" 2>/dev/null; rc=$?
    break
  fi
  if [ "$done_pid" = "$DRIVER_PID" ]; then rc=$status; break; fi
  for node in "${!RAY_SRUN[@]}"; do [ "${RAY_SRUN[$node]}" = "$done_pid" ] && LOST+=("$node"); done
  err "Ray on node ${LOST[*]} ended while the driver ran (status $status); stopping the driver"
  watch=("$DRIVER_PID")
  signal_driver
done
DRIVER_PID=""
log "driver exited with status $rc"
# Status 0 means the run finished (`megarl train` exits 143 when SIGTERM stopped it early).
if [ "$PREEMPTED_DURING_RUN" = 1 ] && [ "$rc" -ne 0 ]; then
  requeue_and_exit "preempted while the driver ran (status $rc; it saved a checkpoint; the next run resumes)"
fi
if [ ${#LOST[@]} -gt 0 ]; then
  fail "lost the Ray node(s) ${LOST[*]} during the run; the driver's last checkpoint is where a new job resumes"
fi
[ "$TERMINATED" = 1 ] && [ $rc -eq 0 ] && rc=143
exit "$rc"
