#!/usr/bin/env bash
# A real two-node Slurm cluster on this one machine, for the Ray-on-Slurm tests and for trying
# launch_scripts/ray_on_slurm.sh by hand. Idempotent: a cluster that is already up is left as it is.
#
#   bash ci/slurm_up.sh            # then: export SLURM_CONF=$MEGARL_SLURM_DIR/slurm.conf; sinfo
#   bash ci/slurm_down.sh          # stops exactly what this script started
#
# What it does (as root; Debian 12's Slurm 22.05 and munge, see docs/cpu.md):
#   - installs slurmctld slurmd slurm-client munge if missing (apt-get, no recommends);
#   - writes everything into one state dir it owns ($MEGARL_SLURM_DIR, default /tmp/megarl-slurm):
#     slurm.conf, gres.conf, a munge key and socket, spool/state dirs, logs, pids;
#   - maps n1 -> 127.0.0.11 and n2 -> 127.0.0.12 in /etc/hosts (a marked block that down removes);
#   - starts munged, slurmctld and two slurmd "nodes" n1/n2 (each in its own UTS namespace with its
#     own hostname, so `hostname` and `hostname --ip-address` inside a job name the node), each with
#     $MEGARL_SLURM_CPUS CPUs (default 2) and two fake GPUs (gres gpu:2 on char devices);
#   - records the PIDs it started in $MEGARL_SLURM_DIR/pids and waits until sinfo shows both nodes idle.
#
# Knobs: MEGARL_SLURM_DIR, MEGARL_SLURM_PORT (slurmctld port; slurmd n1/n2 use the next two,
# default 6817), MEGARL_SLURM_CPUS, MEGARL_SLURM_UP_TIMEOUT (seconds, default 60).
# Clients need SLURM_CONF=$MEGARL_SLURM_DIR/slurm.conf (the system's /etc/slurm is not touched).
set -euo pipefail

DIR=${MEGARL_SLURM_DIR:-/tmp/megarl-slurm}
PORT=${MEGARL_SLURM_PORT:-6817}
CPUS=${MEGARL_SLURM_CPUS:-2}
TIMEOUT=${MEGARL_SLURM_UP_TIMEOUT:-60}
NODES=(n1 n2)
declare -A NODE_IP=([n1]=127.0.0.11 [n2]=127.0.0.12)
HOSTS_BEGIN="# BEGIN megarl-slurm test cluster (made by slurm_up.sh, removed by slurm_down.sh)"
HOSTS_END="# END megarl-slurm"
export SLURM_CONF="$DIR/slurm.conf"

say() { echo "slurm_up: $*"; }
# One up/down at a time on this host (test sessions may start together).
if [ -z "${MEGARL_SLURM_LOCKED:-}" ]; then
  exec 9>"${DIR%/}.lock"
  flock -w 300 9 || { echo "${0##*/}: ERROR: ${DIR%/}.lock held for 300 s" >&2; exit 1; }
fi
die() { echo "slurm_up: ERROR: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (it starts slurmd/slurmctld/munged and edits /etc/hosts)"

alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }

# ---------------------------------------------------------------- already up?
if [ -f "$DIR/pids" ]; then
  all_alive=1
  while read -r name pid; do alive "$pid" || all_alive=0; done < "$DIR/pids"
  if [ "$all_alive" = 1 ] && sinfo -h -N -o '%N %t' >/dev/null 2>&1; then
    say "already up (pids in $DIR/pids); SLURM_CONF=$SLURM_CONF"
    sinfo -N -o '%N %t %c %G' | sed 's/^/slurm_up:   /'
    exit 0
  fi
  say "a previous cluster in $DIR is (partly) down: stopping its rest first"
  MEGARL_SLURM_LOCKED=1 bash "$(dirname "${BASH_SOURCE[0]}")/slurm_down.sh"
fi

# ---------------------------------------------------------------- packages
missing=()
for pkg in slurmctld slurmd slurm-client munge; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]} (apt-get, no recommends)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || die "apt-get update failed"
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >"/tmp/megarl-slurm-apt.log" 2>&1 \
    || die "apt-get install ${missing[*]} failed; see /tmp/megarl-slurm-apt.log"
else
  say "packages present: slurmctld slurmd slurm-client munge ($(slurmd -V))"
fi
for tool in slurmctld slurmd munged sinfo unshare setsid setpriv; do
  command -v "$tool" >/dev/null || die "$tool not found after installing the packages"
done

# ---------------------------------------------------------------- state dir, munge key, config
say "state dir $DIR"
if [ -d "$DIR" ] && [ ! -f "$DIR/.megarl-slurm" ] && [ -n "$(ls -A "$DIR")" ]; then
  die "$DIR exists and was not made by this script (no .megarl-slurm marker); set MEGARL_SLURM_DIR elsewhere"
fi
rm -rf "$DIR"
mkdir -p "$DIR"/{state,log,spool/n1,spool/n2,dev,munge}
touch "$DIR/.megarl-slurm"
chmod 0755 "$DIR"
dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1 count=1024 status=none
chown -R munge:munge "$DIR/munge"
chmod 0700 "$DIR/munge"
chmod 0400 "$DIR/munge/munge.key"

# Fake GPUs: char devices (like /dev/null) that Slurm's gres plugin can hand out.
gres_ok=1
for i in 0 1; do mknod "$DIR/dev/gpu$i" c 1 3 2>/dev/null || gres_ok=0; done
CTLD_HOST=$(hostname -s)
{
  echo "# Written by ci/slurm_up.sh: a two-node test cluster on one host (docs/cpu.md)."
  echo "ClusterName=megarl"
  echo "SlurmctldHost=${CTLD_HOST}(127.0.0.1)"
  echo "SlurmctldPort=$PORT"
  echo "SlurmUser=root"
  echo "SlurmdUser=root"
  echo "AuthType=auth/munge"
  echo "CredType=cred/munge"
  # cred_expire also sets how long a requeued job waits before it may start again (default 120 s).
  echo "AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=10"
  echo "StateSaveLocation=$DIR/state"
  echo "SlurmdSpoolDir=$DIR/spool/%n"
  echo "SlurmctldPidFile=$DIR/slurmctld.pid"
  echo "SlurmdPidFile=$DIR/slurmd-%n.pid"
  echo "SlurmctldLogFile=$DIR/log/slurmctld.log"
  echo "SlurmdLogFile=$DIR/log/slurmd-%n.log"
  echo "ProctrackType=proctrack/linuxproc"
  echo "TaskPlugin=task/none"
  echo "MpiDefault=none"
  echo "SelectType=select/cons_tres"
  echo "SelectTypeParameters=CR_CPU"
  echo "SchedulerType=sched/backfill"
  echo "SchedulerParameters=sched_interval=2,bf_interval=2"
  echo "JobAcctGatherType=jobacct_gather/none"
  echo "AccountingStorageType=accounting_storage/none"
  echo "JobCompType=jobcomp/filetxt"
  echo "JobCompLoc=$DIR/log/jobcomp.txt"
  echo "ReturnToService=2"
  echo "SlurmdParameters=config_overrides"
  echo "MailProg=/bin/true"
  echo "MinJobAge=600"
  echo "KillWait=10"
  echo "JobRequeue=1"
  echo "SlurmdTimeout=60"
  [ "$gres_ok" = 1 ] && echo "GresTypes=gpu"
  for n in "${NODES[@]}"; do
    p=$((PORT + ${n#n}))
    gres=""; [ "$gres_ok" = 1 ] && gres=" Gres=gpu:2"
    echo "NodeName=$n NodeAddr=${NODE_IP[$n]} NodeHostname=$n Port=$p CPUs=$CPUS RealMemory=8000$gres State=UNKNOWN"
  done
  echo "PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP"
} > "$DIR/slurm.conf"
if [ "$gres_ok" = 1 ]; then
  for n in "${NODES[@]}"; do echo "NodeName=$n Name=gpu File=$DIR/dev/gpu[0-1]"; done > "$DIR/gres.conf"
else
  say "mknod failed: no fake GPU gres on this machine"
fi

# ---------------------------------------------------------------- /etc/hosts block
strip_hosts_block() {  # rewrite in place (a bind-mounted /etc/hosts cannot be replaced by rename)
  local tmp; tmp=$(mktemp)
  awk -v b="$HOSTS_BEGIN" -v e="$HOSTS_END" '$0 == b {skip = 1} !skip {print} $0 == e {skip = 0}' /etc/hosts > "$tmp" && cat "$tmp" > /etc/hosts; rm -f "$tmp"
}
strip_hosts_block
{
  echo "$HOSTS_BEGIN"
  for n in "${NODES[@]}"; do echo "${NODE_IP[$n]} $n"; done
  echo "$HOSTS_END"
} >> /etc/hosts
say "/etc/hosts: $(for n in "${NODES[@]}"; do printf '%s=%s ' "$n" "${NODE_IP[$n]}"; done)"

# ---------------------------------------------------------------- daemons
# (9>&-: the daemons must not inherit the lock's file descriptor, or they would hold the lock.)
: > "$DIR/pids"
record() { echo "$1 $2" >> "$DIR/pids"; say "started $1 (pid $2)"; }

mkdir -p /run/munge  # munge's client library falls back to this dir's socket path in messages
setsid setpriv --reuid=munge --regid=munge --init-groups munged --foreground --force --key-file="$DIR/munge/munge.key" \
  --socket="$DIR/munge/munge.socket" --pid-file="$DIR/munge/munged.pid" --seed-file="$DIR/munge/munged.seed" \
  --log-file="$DIR/log/munged.log" </dev/null >>"$DIR/log/munged.out" 2>&1 9>&- &
record munged $!
for _ in $(seq 50); do [ -S "$DIR/munge/munge.socket" ] && break; sleep 0.1; done
[ -S "$DIR/munge/munge.socket" ] || die "munged did not create its socket; see $DIR/log/munged.log"

setsid slurmctld -D -c -f "$SLURM_CONF" </dev/null >>"$DIR/log/slurmctld.out" 2>&1 9>&- &
record slurmctld $!

for n in "${NODES[@]}"; do
  # Own UTS namespace -> own hostname for the node and every job step it starts.
  setsid unshare --uts sh -c "hostname $n && exec slurmd -D -N $n -f '$SLURM_CONF'" \
    </dev/null >>"$DIR/log/slurmd-$n.out" 2>&1 9>&- &
  record "slurmd-$n" $!
done

# ---------------------------------------------------------------- wait for idle nodes
deadline=$((SECONDS + TIMEOUT))
while :; do
  states=$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u || true)
  idle=$(echo "$states" | awk '$2 == "idle"' | wc -l)
  [ "$idle" -ge ${#NODES[@]} ] && break
  while read -r name pid; do
    alive "$pid" || die "$name (pid $pid) exited during start-up; see $DIR/log/ ($(tail -n 3 "$DIR/log/$name.log" "$DIR/log/$name.out" 2>/dev/null | tr '\n' ' '))"
  done < "$DIR/pids"
  if echo "$states" | grep -Eq ' (drain|drng|down)'; then  # a node left DOWN by an earlier run
    for n in $(echo "$states" | awk '$2 ~ /drain|drng|down/ {print $1}'); do
      scontrol update NodeName="$n" State=RESUME 2>/dev/null || true
    done
  fi
  if [ $SECONDS -ge $deadline ]; then
    die "nodes not idle after ${TIMEOUT}s (sinfo: ${states:-no answer from slurmctld}); logs in $DIR/log/"
  fi
  sleep 0.5
done
say "up: $(echo "$states" | tr '\n' ' ')"
say "use: export SLURM_CONF=$SLURM_CONF"
