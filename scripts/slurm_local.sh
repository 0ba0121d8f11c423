#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine, on loopback only, for tests/run/test_slurm.py and .ci/run:
#   scripts/slurm_local.sh up      munged, slurmctld and slurmd on 127.0.0.1; waits until the node is idle
#   scripts/slurm_local.sh down    stops every daemon `up` started, by the pids it recorded, and removes the folder
#   scripts/slurm_local.sh env     prints `export SLURM_CONF=...`: clients (sbatch, squeue, sacct) find it by that
# Everything lives in one folder, KVBENCH_SLURM_DIR (default /tmp/kvbench-slurm): slurm.conf, the munge key and
# socket, the daemons' state, logs and pids. Nothing under /etc is touched, so a machine's own SLURM is left alone.
# Needs root (slurmd starts jobs as their user) and Debian's packages: apt-get install -y slurm-wlm munge.
#
# The config is the least a job needs: one partition holding the node's CPUs, memory as a consumable resource, no
# cgroups (proctrack/linuxproc, task/none; a container rarely delegates them), so a job's --mem is enforced by
# polling (jobacct_gather/linux with OverMemoryKill: the whole step is killed once its processes' RSS passes it).
# No accounting database: sacct answers nothing, which submitit's job watcher tolerates (it reads a job's result
# file); harness/run/slurm_watch.py gives it squeue's view so that a cancelled job ends the wait too.
set -euo pipefail

DIR=${KVBENCH_SLURM_DIR:-/tmp/kvbench-slurm}
CTLD_PORT=${KVBENCH_SLURM_CTLD_PORT:-16817}   # not SLURM's 6817/6818: a machine's own cluster keeps its ports
SLURMD_PORT=${KVBENCH_SLURM_SLURMD_PORT:-16818}
WAIT_S=${KVBENCH_SLURM_WAIT_S:-60}
DAEMONS=(slurmd slurmctld munged)              # the order `down` stops them in
MARK="KVBENCH_SLURM_CLUSTER=$DIR"               # in the daemons' environment alone: how `down` knows their processes

die() { echo "slurm_local.sh: $*" >&2; exit 1; }

# A daemon that would not start: its log's last lines in the one line, then whatever did start is stopped.
not_started() {
  local last
  last=$(tail -n 2 "$DIR/log/$1.log" 2>/dev/null | tr '\n' ' ')
  down >/dev/null 2>&1 || true
  die "$1 did not start${last:+: $last}"
}

need() {
  local missing=()
  for bin in munged mungekey slurmctld slurmd sinfo sbatch; do
    command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || missing+=("$bin")
  done
  [ ${#missing[@]} -eq 0 ] || die "missing ${missing[*]}: apt-get install -y slurm-wlm munge"
  [ "$(id -u)" = 0 ] || die "needs root (slurmd starts each job as its user)"
}

write_conf() {
  local node cpus mem_mb
  node=$(hostname -s)
  cpus=$(nproc)
  mem_mb=$(( $(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1024 * 9 / 10 ))   # 90%: the rest stays the host's
  cat >"$DIR/slurm.conf" <<EOF
# Written by scripts/slurm_local.sh: a one-node cluster on loopback, for tests.
ClusterName=kvbench
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ReturnToService=2
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=task=1
JobAcctGatherParams=OverMemoryKill
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
MinJobAge=3600
KillWait=5
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munge() {
  mkdir -p "$DIR/munge"
  chmod 0700 "$DIR/munge"
  mungekey --create --keyfile="$DIR/munge/munge.key" --force >/dev/null
  chmod 0600 "$DIR/munge/munge.key"
  env "$MARK" munged --force --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" \
    --pid-file="$DIR/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munge.seed" \
    || not_started munged
}

up() {
  need
  if [ -f "$DIR/slurmctld.pid" ] && kill -0 "$(cat "$DIR/slurmctld.pid")" 2>/dev/null; then
    die "a cluster is already up in $DIR (scripts/slurm_local.sh down first)"
  fi
  rm -rf "$DIR"
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
  write_conf
  local conf=$DIR/slurm.conf
  start_munge
  env "$MARK" SLURM_CONF="$conf" slurmctld -f "$conf" \
    || not_started slurmctld
  env "$MARK" SLURM_CONF="$conf" slurmd -f "$conf" -N "$(hostname -s)" \
    || not_started slurmd
  local deadline=$(( SECONDS + WAIT_S )) state=""
  while [ $SECONDS -lt $deadline ]; do
    state=$(SLURM_CONF=$conf sinfo -h -N -o %t 2>/dev/null | head -n 1 || true)
    [ "$state" = idle ] && { echo "slurm_local.sh: node $(hostname -s) idle; export SLURM_CONF=$conf"; return; }
    sleep 1
  done
  down >/dev/null 2>&1 || true
  die "the node did not become idle within ${WAIT_S}s (sinfo said '${state:-nothing}'); see the logs under $DIR/log"
}

# Every process this cluster started: its daemons and their slurmstepd (which carry the MARK that `up` gave the
# daemons alone), and the jobs' own processes (a SLURM_JOB_ID, and this cluster's SLURM_CONF from sbatch).
cluster_pids() {
  local proc pid environ
  for proc in /proc/[0-9]*; do
    pid=${proc#/proc/}
    [ "$pid" = $$ ] && continue
    environ=$(tr '\0' '\n' 2>/dev/null <"$proc/environ") || continue
    if grep -qxF "$MARK" <<<"$environ" \
      || { grep -qxF "SLURM_CONF=$DIR/slurm.conf" <<<"$environ" && grep -q '^SLURM_JOB_ID=' <<<"$environ"; }; then
      echo "$pid"
    fi
  done
  return 0
}

down() {
  [ -d "$DIR" ] || return 0
  local pid jobs conf=$DIR/slurm.conf
  jobs=$(SLURM_CONF=$conf squeue -h -o %A 2>/dev/null || true)   # cancel what still runs: its steps end cleanly
  if [ -n "$jobs" ]; then
    SLURM_CONF=$conf scancel $jobs 2>/dev/null || true
    for _ in $(seq 30); do [ -z "$(SLURM_CONF=$conf squeue -h 2>/dev/null)" ] && break; sleep 0.5; done
  fi
  for daemon in "${DAEMONS[@]}"; do
    [ -f "$DIR/$daemon.pid" ] || continue
    pid=$(cat "$DIR/$daemon.pid")
    kill "$pid" 2>/dev/null || continue
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -9 "$pid" 2>/dev/null || true
  done
  for pid in $(cluster_pids); do kill -9 "$pid" 2>/dev/null || true; done   # slurmstepd outlives slurmd by design
  sleep 0.5
  local left
  left=$(cluster_pids | tr '\n' ' ')
  [ -z "$left" ] || die "processes of the cluster in $DIR survived down: $left"
  rm -rf "$DIR"
  echo "slurm_local.sh: the cluster in $DIR is down"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  env) echo "export SLURM_CONF=$DIR/slurm.conf" ;;
  *) die "usage: scripts/slurm_local.sh up|down|env" ;;
esac
