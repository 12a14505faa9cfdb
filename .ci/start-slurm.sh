#!/usr/bin/env bash
# Start a Slurm cluster on loopback for the Slurm launcher's tests (tests/test_slurm.py):
#   munged (--force, its own socket), one slurmctld, two slurmd (nodes n1, n2 on 127.0.0.1,
#   distinct ports), and two partitions over both nodes: "low" (the default, preemptable with
#   PreemptMode=REQUEUE after GraceTime) and "high" (a higher PriorityTier: its jobs preempt).
# Installs Debian's slurm-wlm and munge first if missing (needs root and apt, ~1 min).
# State, logs and the config live under $STOKER_SLURM_DIR (default /tmp/stoker-slurm).
# Idempotent: reuses daemons that answer. `start-slurm.sh stop` stops them (by their pid files).
# Prints the env to export (SLURM_CONF).
set -euo pipefail
dir=${STOKER_SLURM_DIR:-/tmp/stoker-slurm}
grace_s=${STOKER_SLURM_GRACE_S:-20}
ctld_port=${STOKER_SLURM_PORT:-16817}
mkdir -p "$dir"/{state,spool,log,run}
export SLURM_CONF="$dir/slurm.conf"

# A pid file outlives its daemon (a reboot, a machine started from a copy of this /tmp) and its
# number is soon another process's: a daemon runs only if its pid is that program ($2).
alive() {
  [ -f "$1" ] || return 1
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [[ "$pid" =~ ^[0-9]+$ ]] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]
}

stop() {
  for pidfile in "$dir"/run/slurmd-n1.pid "$dir"/run/slurmd-n2.pid "$dir"/run/slurmctld.pid \
                 "$dir"/run/munged.pid; do
    [ -f "$pidfile" ] || continue
    name=$(basename "$pidfile" .pid); name=${name%-n[12]}
    # only the daemon the file names: its number may since be another process's
    if alive "$pidfile" "$name"; then
      pid=$(cat "$pidfile")
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    fi
    rm -f "$pidfile"
  done
}
if [ "${1:-}" = stop ]; then stop; exit 0; fi

need=()
command -v slurmctld >/dev/null 2>&1 || need+=(slurm-wlm)
command -v munged >/dev/null 2>&1 || need+=(munge)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing ${need[*]}" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

# munged answers: a credential it encodes decodes again.
munge_ok() { munge -n -S "$dir/munge.socket" 2>/dev/null | unmunge -S "$dir/munge.socket" >/dev/null 2>&1; }

if [ ! -f "$dir/munge.key" ]; then
  dd if=/dev/urandom bs=1 count=1024 of="$dir/munge.key" status=none
  chmod 400 "$dir/munge.key"
fi
if ! munge_ok; then
  alive "$dir/run/munged.pid" munged && kill "$(cat "$dir/run/munged.pid")" 2>/dev/null || true
  # A socket left by a munged that is gone refuses connections: slurmctld and slurmd would start
  # and every node stay down ("Munge encode failed ... Connection refused").
  rm -f "$dir/munge.socket" "$dir/munge.socket.lock" "$dir/run/munged.pid"
  # --force: munged refuses a key or socket folder it finds too open (here: /tmp).
  munged --force --key-file="$dir/munge.key" --socket="$dir/munge.socket" \
    --pid-file="$dir/run/munged.pid" --log-file="$dir/log/munged.log" \
    --seed-file="$dir/munge.seed"
  for _ in $(seq 1 20); do munge_ok && break; sleep 0.5; done
  if ! munge_ok; then
    echo "munged does not answer on $dir/munge.socket:" >&2
    tail -20 "$dir/log/munged.log" >&2 || true
    exit 1
  fi
fi

host=$(hostname -s)
cpus=$(nproc)
cat >"$SLURM_CONF.new" <<CONF
ClusterName=stoker
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge.socket
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
# No cgroups here: processes are tracked by parent, tasks are not confined.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# No accounting database: finished jobs are read with scontrol, kept this long (s).
MinJobAge=900
SelectType=select/linear
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
MpiDefault=none
# Bind to the nodes' and the controller's addresses (127.0.0.1 here), not to every interface:
# NoInAddrAny for slurmd and the clients, NoCtldInAddrAny for slurmctld (SlurmctldHost's address).
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName=n1 NodeHostname=$host NodeAddr=127.0.0.1 Port=$((ctld_port + 1)) CPUs=$cpus State=UNKNOWN
NodeName=n2 NodeHostname=$host NodeAddr=127.0.0.1 Port=$((ctld_port + 2)) CPUs=$cpus State=UNKNOWN
PartitionName=low Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=$grace_s
PartitionName=high Nodes=n1,n2 MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
CONF
mv "$SLURM_CONF.new" "$SLURM_CONF"

if ! alive "$dir/run/slurmctld.pid" slurmctld; then
  slurmctld -f "$SLURM_CONF"
fi
for node in n1 n2; do
  alive "$dir/run/slurmd-$node.pid" slurmd || slurmd -f "$SLURM_CONF" -N "$node"
done
for _ in $(seq 1 60); do
  idle=$(sinfo -h -N -o '%N %t' 2>/dev/null | grep -cE ' (idle|alloc|mix)' || true)
  [ "$idle" -ge 4 ] && break  # two nodes, listed once per partition
  sleep 1
done
if [ "${idle:-0}" -lt 4 ]; then
  sinfo -N >&2 || true
  tail -20 "$dir/log/slurmctld.log" >&2 || true
  exit 1
fi
echo "export SLURM_CONF=$SLURM_CONF"
