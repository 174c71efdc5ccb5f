#!/usr/bin/env bash
# A real 2-node SLURM cluster on this one machine, for the `slurm` tests (run as root).
#   scripts/local_slurm.sh start    # installs slurm-wlm (apt) if needed, starts munge, slurmctld, 2 slurmd
#   scripts/local_slurm.sh stop
#   scripts/local_slurm.sh status
# Nodes n1 and n2 both resolve to 127.0.0.1 and have one CPU each; slurmd ports 17001-17002.
set -euo pipefail

CONF_DIR=/etc/slurm
STATE=/var/spool/slurm-local

install() {
    if ! command -v slurmctld >/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm >/dev/null
    fi
}

write_config() {
    mkdir -p "$CONF_DIR" "$STATE"/ctld /var/log/slurm
    local host cpus
    host=$(hostname)
    cat > "$CONF_DIR/slurm.conf" <<CONF
ClusterName=local
SlurmctldHost=$host
SlurmUser=root
SlurmctldPort=16817
SlurmdPort=16818
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d-%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
MpiDefault=none
JobRequeue=1
KillWait=30
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
NodeName=n[1-2] NodeHostname=$host NodeAddr=127.0.0.1 Port=17001-17002 CPUs=1 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
    # The node names must resolve (the multi-node script uses the first one as the main address).
    grep -qE '^127\.0\.0\.1[[:space:]].*\bn1\b' /etc/hosts || echo "127.0.0.1 n1 n2" >> /etc/hosts
}

start() {
    install
    write_config
    mkdir -p /run/munge && chown munge:munge /run/munge
    [ -s /etc/munge/munge.key ] || (/usr/sbin/mungekey --create 2>/dev/null || create-munge-key -f)
    pgrep -x munged >/dev/null || su -s /bin/sh munge -c /usr/sbin/munged
    pgrep -x slurmctld >/dev/null || slurmctld
    pgrep -f "slurmd -N n1" >/dev/null || slurmd -N n1
    pgrep -f "slurmd -N n2" >/dev/null || slurmd -N n2
    for _ in $(seq 60); do
        if [ "$(sinfo -h -o '%T' 2>/dev/null | sort -u)" = "idle" ]; then
            sinfo
            return 0
        fi
        sleep 1
    done
    echo "the local SLURM cluster did not become idle:" >&2
    sinfo >&2 || true
    tail -20 /var/log/slurm/slurmctld.log >&2 || true
    exit 1
}

stop() {
    pkill -x slurmd || true
    pkill -x slurmctld || true
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) sinfo && squeue ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
