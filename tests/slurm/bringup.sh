#!/usr/bin/env bash
# Bring up a real SLURM cluster on this one machine: munge, slurmctld and NODES slurmd daemons (n1..nN, all on
# 127.0.0.1, one port each). Idempotent: a second call with the cluster up only prints its state.
# Used by tests/test_launch.py (a session fixture brings the cluster up and tears it down).
# Needs root (CI and developer machines here run as root). Debian 12's slurm-wlm 22.05 supports several slurmd per host.
#   env: SLURM_TEST_DIR (default /tmp/megarl-slurm), NODES (default 2), CPUS_PER_NODE (default 1)
#   then: export SLURM_CONF=$SLURM_TEST_DIR/slurm.conf   (every SLURM command reads it; /etc/slurm is not touched)
set -euo pipefail
DIR=${SLURM_TEST_DIR:-/tmp/megarl-slurm}
NODES=${NODES:-2}
CPUS=${CPUS_PER_NODE:-1}
export SLURM_CONF=$DIR/slurm.conf
if [ -f "$DIR/slurmctld.pid" ] && kill -0 "$(cat "$DIR/slurmctld.pid")" 2>/dev/null && sinfo -h >/dev/null 2>&1; then
  echo "[slurm] already up:"; sinfo; exit 0
fi
[ "$(id -u)" = 0 ] || { echo "[slurm] needs root to start munge/slurmd" >&2; exit 1; }
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  echo "[slurm] installing slurm-wlm and munge (Debian packages)"
  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
fi
mkdir -p "$DIR/state"
# munge: the key comes with the package; it refuses dirs and logs not owned by its user
mkdir -p /run/munge /var/log/munge /var/lib/munge
[ -f /etc/munge/munge.key ] || mungekey --create >/dev/null 2>&1 || create-munge-key -f >/dev/null
chown -R munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  su -s /bin/sh munge -c /usr/sbin/munged
  for _ in $(seq 20); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.5; done
fi
munge -n | unmunge >/dev/null || { echo "[slurm] munged did not start" >&2; exit 1; }
# node names must resolve for `scontrol show hostnames` users (rendezvous endpoints): map them to loopback
for i in $(seq 1 "$NODES"); do grep -qE "^127\.0\.0\.1[[:space:]]+n$i\$" /etc/hosts || echo "127.0.0.1 n$i" >> /etc/hosts; done
cat > "$SLURM_CONF" <<CONF
ClusterName=megarl-local
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool-%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
NodeName=n[1-$NODES] NodeHostname=$(hostname -s) NodeAddr=127.0.0.1 Port=17001-$((17000 + NODES)) CPUs=$CPUS RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=n[1-$NODES] Default=YES MaxTime=INFINITE State=UP
CONF
slurmctld -f "$SLURM_CONF"
for i in $(seq 1 "$NODES"); do mkdir -p "$DIR/spool-n$i"; slurmd -N "n$i" -f "$SLURM_CONF"; done
for _ in $(seq 30); do
  [ "$(sinfo -h -o '%T' 2>/dev/null | grep -c idle)" -ge 1 ] && [ "$(sinfo -h -N -o '%T' | grep -c idle)" -eq "$NODES" ] && break
  sleep 0.5
done
sinfo -h -N -o '%N %T' | grep -q idle || { echo "[slurm] nodes did not come up; see $DIR/*.log" >&2; exit 1; }
echo "[slurm] up: SLURM_CONF=$SLURM_CONF"; sinfo
