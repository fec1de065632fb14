#!/usr/bin/env bash
# A single-node Slurm cluster on this machine (Debian's slurm-wlm + munge), so the Slurm launcher
# tests submit real jobs. Idempotent: installs once, writes its own slurm.conf once, and starts
# only the daemons that are not already answering.
#
#   bash .ci/setup_slurm.sh          # install + start munged, slurmctld, slurmd; wait for an idle node
#   bash .ci/setup_slurm.sh stop     # stop (by pid) the daemons this script started
#
# Needs root (or password-less sudo). Facts this relies on (Slurm 22.05): no cgroup.conf
# (22.05 rejects CgroupPlugin=disabled and slurmd then fails), proctrack/linuxproc + task/none,
# munged --force to run as root, and a RealMemory below the machine's.
set -euo pipefail

STATE_DIR=${AREAL_SLURM_STATE_DIR:-/var/lib/arealite-slurm}
PIDS_FILE=$STATE_DIR/pids
CONF=/etc/slurm/slurm.conf
MARKER="# written by arealite .ci/setup_slurm.sh"

if [ "$(id -u)" -eq 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
else
    echo "setup_slurm: needs root or password-less sudo (running as $(id -un))" >&2
    exit 3
fi

log() { echo "setup_slurm: $*"; }

stop_daemons() {
    [ -f "$PIDS_FILE" ] || { log "nothing to stop (no $PIDS_FILE)"; return 0; }
    while read -r name pid; do
        if $SUDO kill -TERM "$pid" 2>/dev/null; then
            for _ in $(seq 50); do $SUDO kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            $SUDO kill -KILL "$pid" 2>/dev/null || true
            log "stopped $name (pid $pid)"
        fi
    done < "$PIDS_FILE"
    $SUDO rm -f "$PIDS_FILE"
}

if [ "${1:-start}" = "stop" ]; then
    stop_daemons
    exit 0
fi

cluster_up() { timeout 10 sinfo -h -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; }

if command -v sinfo >/dev/null && cluster_up; then
    log "a Slurm cluster already answers; nothing to do"
    exit 0
fi

# ---------------------------------------------------------------- install
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    log "installing slurm-wlm + munge (apt)"
    apt_log=$(mktemp)
    if ! { $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq --no-install-recommends slurm-wlm munge; } >"$apt_log" 2>&1; then
        tail -n 30 "$apt_log" >&2
        echo "setup_slurm: apt-get install slurm-wlm munge failed" >&2
        exit 1
    fi
    rm -f "$apt_log"
fi

# ---------------------------------------------------------------- munge
if [ ! -s /etc/munge/munge.key ]; then
    $SUDO mkdir -p /etc/munge
    $SUDO dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
$SUDO chown munge:munge /etc/munge/munge.key
$SUDO chmod 400 /etc/munge/munge.key
# munged runs as root here (--force): its log directory must be root's, its socket dir munge's.
$SUDO mkdir -p /run/munge /var/log/munge /var/lib/munge
$SUDO chown munge:munge /run/munge /var/lib/munge
$SUDO chown root:root /var/log/munge
$SUDO mkdir -p "$STATE_DIR"
$SUDO touch "$PIDS_FILE"

record() { echo "$1 $2" | $SUDO tee -a "$PIDS_FILE" >/dev/null; }

if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    $SUDO munged --force
    for _ in $(seq 50); do [ -s /run/munge/munged.pid ] && break; sleep 0.1; done
    record munged "$(cat /run/munge/munged.pid)"
    log "munged started"
fi

# ---------------------------------------------------------------- slurm.conf
if [ ! -f "$CONF" ] || grep -qF "$MARKER" "$CONF"; then
    host=$(hostname)
    ncpu=$(nproc --all)  # the node's CPUs: plain nproc obeys OMP_NUM_THREADS of the caller
    mem_mb=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
    $SUDO mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
    $SUDO tee "$CONF" >/dev/null <<EOF
$MARKER
ClusterName=arealite
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
SlurmdTimeout=60
KillWait=5
NodeName=$host CPUs=$ncpu RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
fi

# ---------------------------------------------------------------- daemons
start_daemon() {  # name pidfile
    local name=$1 pidfile=$2
    if [ -s "$pidfile" ] && $SUDO kill -0 "$(cat "$pidfile")" 2>/dev/null; then
        return 0
    fi
    $SUDO "$name"
    for _ in $(seq 100); do [ -s "$pidfile" ] && break; sleep 0.1; done
    [ -s "$pidfile" ] || { echo "setup_slurm: $name did not start; see /var/log/slurm/$name.log" >&2; exit 1; }
    record "$name" "$(cat "$pidfile")"
    log "$name started (pid $(cat "$pidfile"))"
}
start_daemon slurmctld /run/slurmctld.pid
start_daemon slurmd /run/slurmd.pid

for i in $(seq 60); do
    cluster_up && { log "node $(hostname) is up: $(sinfo -h -o '%P %D %T %c CPUs')"; exit 0; }
    state=$(sinfo -h -o '%T' 2>/dev/null || true)
    case "$state" in
        down*|drain*) $SUDO scontrol update nodename="$(hostname)" state=resume 2>/dev/null || true ;;
    esac
    sleep 1
done
echo "setup_slurm: the node did not become idle in 60 s (sinfo: $(sinfo 2>&1 | tail -n +2));" \
     "logs under /var/log/slurm/" >&2
exit 1
