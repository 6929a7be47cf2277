#!/usr/bin/env bash
# A real Slurm cluster on this one machine (Debian's slurm-wlm and munge), for tests and for
# trying HELM's SlurmRunner and `srun torchrun ...` before a real cluster.
#
#   cluster/local_slurm.sh start [--nodes N]   install if missing, configure, start, wait for idle
#   cluster/local_slurm.sh status              exit 0 and print sinfo when the nodes answer
#   cluster/local_slurm.sh stop                cancel the jobs, stop every daemon it started
#   cluster/local_slurm.sh env                 the line to paste: export SLURM_CONF=...
#
# Every command is idempotent. Everything lives under $FLEXGEN_SLURM_DIR (default
# /tmp/flexgen-slurm): slurm.conf, state, spool, pid files and logs. Daemons listen on
# 127.0.0.1 only. N nodes (default 2) are N slurmd processes on this host, each with its own
# port and 1/N of the cores and memory, so that 2-node jobs (srun -N 2) run here. Needs root
# (apt-get, and slurmd starts job steps as their user). Every wait is bounded.
set -euo pipefail

DIR=${FLEXGEN_SLURM_DIR:-/tmp/flexgen-slurm}
CONF=$DIR/slurm.conf
CTLD_PORT=${FLEXGEN_SLURM_PORT:-16817}   # slurmd i listens on CTLD_PORT + i
WAIT_S=${FLEXGEN_SLURM_WAIT_S:-60}
MUNGE_SOCKET=$DIR/munge/munge.socket
export SLURM_CONF=$CONF

die() { echo "local_slurm: $*" >&2; exit 1; }
say() { echo "local_slurm: $*" >&2; }

need_root() { [ "$(id -u)" = 0 ] || die "$1 needs root (apt-get, munged, slurmd); run it with sudo"; }

install_if_missing() {
    local missing=()
    for cmd in munged slurmctld slurmd sinfo; do
        command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
    done
    [ ${#missing[@]} = 0 ] && return 0
    command -v apt-get >/dev/null 2>&1 || die "missing ${missing[*]} and no apt-get: install Slurm (slurmctld, slurmd, munge) by hand"
    say "installing slurm-wlm and munge (missing: ${missing[*]})"
    DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y slurm-wlm munge >"$DIR/apt.log" 2>&1 \
        || { apt-get update >>"$DIR/apt.log" 2>&1 && DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y slurm-wlm munge >>"$DIR/apt.log" 2>&1; } \
        || die "apt-get install slurm-wlm munge failed; see $DIR/apt.log"
}

node_count() { grep -c '^NodeName=' "$CONF"; }
pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

write_conf() {
    local nodes=$1 cores mem_mb per_cpu per_mem i
    cores=$(nproc)
    mem_mb=$(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo)
    per_cpu=$(( cores / nodes )); [ "$per_cpu" -ge 1 ] || per_cpu=1
    per_mem=$(( mem_mb * 9 / 10 / nodes ))   # a tenth left to the system
    mkdir -p "$DIR/state" "$DIR/log"
    {
        echo "# written by cluster/local_slurm.sh for $(hostname): $cores cores, $mem_mb MiB, $nodes node(s)"
        echo "ClusterName=flexgen-local"
        echo "SlurmctldHost=$(hostname)(127.0.0.1)"
        echo "SlurmctldPort=$CTLD_PORT"
        echo "SlurmctldParameters=enable_configless"
        echo "AuthType=auth/munge"
        echo "AuthInfo=socket=$MUNGE_SOCKET"
        echo "CredType=cred/munge"
        echo "SlurmUser=root"
        echo "SlurmdUser=root"
        echo "StateSaveLocation=$DIR/state"
        echo "SlurmdSpoolDir=$DIR/spool-%n"
        echo "SlurmctldPidFile=$DIR/slurmctld.pid"
        echo "SlurmdPidFile=$DIR/slurmd-%n.pid"
        echo "SlurmctldLogFile=$DIR/log/slurmctld.log"
        echo "SlurmdLogFile=$DIR/log/slurmd-%n.log"
        # containers rarely give slurmd a cgroup of its own: track processes by parentage
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "AccountingStorageType=accounting_storage/none"
        echo "JobCompType=jobcomp/none"
        echo "MpiDefault=none"
        echo "SchedulerType=sched/backfill"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_Core_Memory"
        # each slurmd declares its share of the machine, not the whole
        echo "SlurmdParameters=config_overrides"
        echo "ReturnToService=2"
        echo "SlurmdTimeout=30"
        echo "KillWait=5"
        echo "MinJobAge=300"
        for i in $(seq 1 "$nodes"); do
            echo "NodeName=node$i NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=$(( CTLD_PORT + i )) CPUs=$per_cpu RealMemory=$per_mem State=UNKNOWN"
        done
        echo "PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
    } >"$CONF.new"
    mv "$CONF.new" "$CONF"
}

start_munge() {
    if pid_alive "$DIR/munge/munged.pid"; then return 0; fi
    mkdir -p "$DIR/munge"
    chown munge: "$DIR/munge"
    chmod 711 "$DIR/munge"
    [ -s /etc/munge/munge.key ] || { mungekey --create --keyfile /etc/munge/munge.key 2>/dev/null \
        || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; \
        chown munge: /etc/munge/munge.key; chmod 400 /etc/munge/munge.key; }
    runuser -u munge -- munged --socket="$MUNGE_SOCKET" --pid-file="$DIR/munge/munged.pid" \
        --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed" \
        || die "munged did not start; see $DIR/munge/munged.log"
    timeout 10 bash -c "until munge -S '$MUNGE_SOCKET' -n </dev/null | unmunge -S '$MUNGE_SOCKET' >/dev/null 2>&1; do sleep 0.2; done" \
        || die "munged started but does not answer on $MUNGE_SOCKET within 10 s; see $DIR/munge/munged.log"
}

start_daemons() {
    local i
    if ! pid_alive "$DIR/slurmctld.pid"; then
        slurmctld -f "$CONF" || die "slurmctld did not start; see $DIR/log/slurmctld.log"
    fi
    for i in $(seq 1 "$(node_count)"); do
        pid_alive "$DIR/slurmd-node$i.pid" && continue
        mkdir -p "$DIR/spool-node$i"
        slurmd -f "$CONF" -N "node$i" || die "slurmd node$i did not start; see $DIR/log/slurmd-node$i.log"
    done
}

wait_idle() {
    local nodes=$1 deadline=$(( SECONDS + WAIT_S )) idle
    while [ $SECONDS -lt $deadline ]; do
        idle=$(timeout 5 sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 ~ /^(idle|mix|alloc)$/' | wc -l || true)
        # sinfo may show the saved state of a previous start: a job on every node proves it
        if [ "$idle" -ge "$nodes" ] && timeout 10 srun -N "$nodes" -t 1 true 2>/dev/null; then return 0; fi
        sleep 1
    done
    timeout 5 sinfo -N 2>&1 >&2 || true
    die "the nodes are not idle after ${WAIT_S} s; see $DIR/log/ (stop with: $0 stop)"
}

cmd_start() {
    local nodes=2
    while [ $# -gt 0 ]; do
        case $1 in
            --nodes) nodes=${2:?--nodes needs a number}; shift 2 ;;
            *) die "unknown option $1 (start [--nodes N])" ;;
        esac
    done
    [[ $nodes =~ ^[1-9][0-9]*$ ]] || die "--nodes must be a positive integer, not $nodes"
    need_root start
    mkdir -p "$DIR"
    install_if_missing
    if [ -f "$CONF" ] && pid_alive "$DIR/slurmctld.pid" && [ "$(node_count)" != "$nodes" ]; then
        die "running with $(node_count) node(s); stop it first to start with $nodes"
    fi
    pid_alive "$DIR/slurmctld.pid" || write_conf "$nodes"
    start_munge
    start_daemons
    wait_idle "$nodes"
    say "up: $nodes node(s), config $CONF; in other shells: export SLURM_CONF=$CONF"
    timeout 5 sinfo -N
}

cmd_status() {
    [ -f "$CONF" ] || die "not configured ($CONF missing); start it: $0 start"
    pid_alive "$DIR/slurmctld.pid" || die "slurmctld is not running; start it: $0 start"
    timeout 10 sinfo -N || die "sinfo failed; see $DIR/log/slurmctld.log"
}

stop_pidfile() {
    local file=$1 pid
    [ -f "$file" ] || return 0
    pid=$(cat "$file")
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid"
        timeout 15 bash -c "while kill -0 $pid 2>/dev/null; do sleep 0.2; done" || { kill -KILL "$pid" 2>/dev/null || true; }
    fi
    rm -f "$file"
}

cmd_stop() {
    [ -f "$CONF" ] || { say "not configured; nothing to stop"; return 0; }
    if pid_alive "$DIR/slurmctld.pid"; then
        timeout 10 scancel --full --user=root 2>/dev/null || true
        timeout 30 bash -c 'while [ -n "$(squeue -h -o %i 2>/dev/null)" ]; do sleep 0.5; done' \
            || say "jobs still listed after 30 s: $(squeue -h -o '%i %T' 2>/dev/null | tr '\n' ' ')"
    fi
    local f
    for f in "$DIR"/slurmd-node*.pid; do [ -e "$f" ] && stop_pidfile "$f"; done
    stop_pidfile "$DIR/slurmctld.pid"
    stop_pidfile "$DIR/munge/munged.pid"
    say "stopped (state kept in $DIR)"
}

case ${1:-} in
    start) shift; cmd_start "$@" ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) die "usage: $0 start [--nodes N] | status | stop | env" ;;
esac
