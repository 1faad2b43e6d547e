#!/usr/bin/env bash
# A real single-node SLURM on this machine, for the sweep tests (tests/test_sweep_slurm.py).
#
# Idempotent: installs slurm-wlm and munge from Debian's packages when missing (root), writes a munge
# key and a one-node slurm.conf describing this machine (`slurmd -C`), starts munged, slurmctld and
# slurmd, and waits until the node answers `sinfo` as idle. Run as root; CI (.ci/run) calls it.
#   bash scripts/slurm_setup.sh          # set up and start
#   bash scripts/slurm_setup.sh --stop   # stop the daemons
set -euo pipefail

CONF_DIR=/etc/slurm
STATE_DIR=/var/spool/slurmctld
SPOOL_DIR=/var/spool/slurmd
LOG_DIR=/var/log/slurm

log() { echo "slurm_setup: $*" >&2; }

if [[ "${1:-}" == "--stop" ]]; then
    pkill -x slurmd || true
    pkill -x slurmctld || true
    # A daemon still shutting down would make the next set-up think it is running.
    for _ in $(seq 1 30); do
        pgrep -x slurmd >/dev/null || pgrep -x slurmctld >/dev/null || break
        sleep 0.5
    done
    log "stopped slurmd and slurmctld"
    exit 0
fi

if [[ $(id -u) -ne 0 ]]; then
    log "must run as root (it installs packages and starts system daemons)"
    exit 2
fi

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    log "installing slurm-wlm and munge"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
fi

# munge authenticates every RPC between the SLURM commands and the daemons.
mkdir -p /etc/munge /var/lib/munge /var/log/munge /run/munge
if [[ ! -s /etc/munge/munge.key ]]; then
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
fi
chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge /run/munge
chmod 0700 /etc/munge /var/lib/munge /var/log/munge
chmod 0400 /etc/munge/munge.key
chmod 0755 /run/munge
if ! pgrep -x munged >/dev/null; then
    runuser -u munge -- /usr/sbin/munged
fi

node=$(hostname -s)
# `slurmd -C` prints this machine's NodeName line (CPUs, sockets, cores, RealMemory).
hardware=$(slurmd -C | head -n 1 | sed -e "s/^NodeName=[^ ]*/NodeName=$node/")
mkdir -p "$CONF_DIR" "$STATE_DIR" "$SPOOL_DIR" "$LOG_DIR"
cat >"$CONF_DIR/slurm.conf.new" <<EOF
# Written by tsenor's scripts/slurm_setup.sh: one node, one default partition, no cgroups.
ClusterName=tsenor
SlurmctldHost=$node
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# Without a default every job asks for the whole node's memory and array tasks run one at a time.
DefMemPerCPU=2048
SchedulerType=sched/backfill
# Preemption and time-limit tests requeue jobs; a requeued job may start again at once.
JobRequeue=1
MinJobAge=300
ReturnToService=2
StateSaveLocation=$STATE_DIR
SlurmdSpoolDir=$SPOOL_DIR
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
MpiDefault=none
$hardware State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
changed=1
if cmp -s "$CONF_DIR/slurm.conf.new" "$CONF_DIR/slurm.conf"; then
    changed=0
fi
mv "$CONF_DIR/slurm.conf.new" "$CONF_DIR/slurm.conf"
# The Debian package ships a cgroup plugstack; with task/none and linuxproc nothing reads it.

if ! pgrep -x slurmctld >/dev/null; then
    slurmctld
elif [[ $changed -eq 1 ]]; then
    scontrol reconfigure
fi
if ! pgrep -x slurmd >/dev/null; then
    slurmd
fi

for _ in $(seq 1 60); do
    state=$(sinfo --noheader --nodes="$node" --format=%t 2>/dev/null || true)
    if [[ "$state" == "idle" || "$state" == "mix" || "$state" == "alloc" ]]; then
        log "node $node is $state; partition debug is up"
        exit 0
    fi
    if [[ "$state" == "down" || "$state" == "drain" || "$state" == "down*" ]]; then
        scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true
    fi
    sleep 1
done
log "the node did not come up within 60 s; see $LOG_DIR/slurmctld.log and $LOG_DIR/slurmd.log"
exit 1
