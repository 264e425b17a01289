#!/usr/bin/env bash
# A real single-node Slurm (munge, MariaDB + slurmdbd, slurmctld, slurmd) on a Debian machine, as
# root, without systemd: for the Slurm tests and for trying the launcher locally.
#
#   slurm/dev-cluster.sh up      install (apt) if needed, configure, start; idempotent (<1 s when up)
#   slurm/dev-cluster.sh down    stop the daemons (by PID file); --cancel-jobs cancels jobs first
#   slurm/dev-cluster.sh status  sinfo + squeue
#
# Facts behind the settings (measured on this kind of machine): NodeName must equal `hostname -s`
# with NodeAddr 127.0.0.1; no cgroups (proctrack/linuxproc, task/none); slurmdbd so that submitit can
# read job states with sacct; cred_expire=10 and a 2 s scheduler interval so a requeued job restarts
# in ~13 s instead of ~3 min. Job ids restart at 1 when the state is wiped: use a fresh submitit
# folder per run.
set -euo pipefail

cmd=${1:-up}
case "$cmd" in
  up) ;;
  down)
    set +e
    stop() { # pidfile name
      local f=$1 n=$2 p
      [ -s "$f" ] || { echo "$n: no pidfile"; return 0; }
      p=$(cat "$f")
      if kill -0 "$p" 2>/dev/null; then
        kill "$p"
        for _ in $(seq 150); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$p" 2>/dev/null && { echo "$n ($p) did not stop in 15s, SIGKILL"; kill -9 "$p"; }
        echo "$n ($p) stopped"
      else echo "$n: not running"; fi
      rm -f "$f"
    }
    if [ "${2:-}" = "--cancel-jobs" ] && [ -s /run/slurmctld.pid ]; then
      scancel --user=root 2>/dev/null; sleep 3
    fi
    stop /run/slurmd.pid slurmd
    stop /run/slurmctld.pid slurmctld
    stop /run/slurmdbd.pid slurmdbd
    stop /run/mysqld/mysqld.pid mariadbd
    stop /run/munge/munged.pid munged
    exit 0 ;;
  status) sinfo; squeue; exit 0 ;;
  *) echo "usage: $0 up|down [--cancel-jobs]|status" >&2; exit 2 ;;
esac

t0=$(date +%s)
log() { echo "[dev-cluster +$(( $(date +%s) - t0 ))s] $*"; }

PARTITION=${SLURM_CI_PARTITION:-debug}
# 1 = real accounting (MariaDB + slurmdbd) so `sacct` works (submitit polls sacct); 0 = no DB
ACCOUNTING=${SLURM_CI_ACCOUNTING:-1}
NODE=$(hostname -s)
CONF=/etc/slurm/slurm.conf
LOGDIR=/var/log/slurm
export DEBIAN_FRONTEND=noninteractive

# 1. packages ---------------------------------------------------------------
PKGS="slurmctld slurmd slurm-client munge"
[ "$ACCOUNTING" = 1 ] && PKGS="$PKGS slurmdbd mariadb-server"
MISSING=$(for p in $PKGS; do dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q 'ok installed' || echo "$p"; done)
if [ -n "$MISSING" ]; then
  log "installing:" $MISSING
  # keep postinst scripts from starting services (there is no init system); skip man-db rebuild
  CREATED_POLICY=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; CREATED_POLICY=1; fi
  echo 'man-db man-db/auto-update boolean false' | debconf-set-selections 2>/dev/null || true
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends $MISSING >/dev/null
  [ "$CREATED_POLICY" = 1 ] && rm -f /usr/sbin/policy-rc.d
  log "packages installed"
fi
log "slurm $(dpkg-query -W -f='${Version}' slurmctld), munge $(dpkg-query -W -f='${Version}' munge)"

# 2. munge ------------------------------------------------------------------
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
  log "starting munged"
  rm -f /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock /run/munge/munged.pid
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 50); do munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
fi
munge -n </dev/null | unmunge >/dev/null

# 3. accounting DB (optional) ------------------------------------------------
running() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
if [ "$ACCOUNTING" = 1 ]; then
  install -d -o mysql -g mysql -m 0755 /run/mysqld
  install -d -m 0755 "$LOGDIR"
  [ -d /var/lib/mysql/mysql ] || mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
  if ! mariadb -e 'select 1' >/dev/null 2>&1; then
    log "starting mariadbd"
    # setsid + redirects: fully detached from the CI step's shell
    setsid mariadbd --user=mysql --bind-address=127.0.0.1 --pid-file=/run/mysqld/mysqld.pid \
      --innodb-buffer-pool-size=256M --innodb-lock-wait-timeout=900 \
      --log-error=$LOGDIR/mariadb.err </dev/null >/dev/null 2>&1 &
    for _ in $(seq 150); do mariadb -e 'select 1' >/dev/null 2>&1 && break; sleep 0.2; done
  fi
  mariadb -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
    CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurmci';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"
  cat > /etc/slurm/slurmdbd.conf <<DBDEOF
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=6819
SlurmUser=root
LogFile=$LOGDIR/slurmdbd.log
PidFile=/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurmci
StorageLoc=slurm_acct_db
DBDEOF
  chmod 600 /etc/slurm/slurmdbd.conf
  if ! running /run/slurmdbd.pid; then
    log "starting slurmdbd"
    slurmdbd
    for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/6819) 2>/dev/null && break; sleep 0.2; done
  fi
  ACCT_LINES="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819"
else
  ACCT_LINES="AccountingStorageType=accounting_storage/none"
fi

# 4. slurm.conf -------------------------------------------------------------
install -d -m 0755 /etc/slurm "$LOGDIR" /var/spool/slurmctld /var/spool/slurmd
# CPUs/sockets/cores/memory exactly as slurmd detects them (avoids the node being drained)
HW=$(slurmd -C | head -1 | sed -e 's/^NodeName=[^ ]* //')
cat > "$CONF.new" <<CONFEOF
ClusterName=ci
SlurmctldHost=${NODE}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued job waits before it may start again (default 120 s)
AuthInfo=cred_expire=10
MpiDefault=none
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOGDIR/slurmctld.log
SlurmdLogFile=$LOGDIR/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
# no cgroups: works in containers / without systemd
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
SchedulerType=sched/backfill
# re-evaluate pending jobs every 2 s (default 60 s main loop, 30 s backfill) so requeued jobs restart fast
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
${ACCT_LINES}
# plain-text completion log (readable with: sacct --completion, even without slurmdbd)
JobCompType=jobcomp/filetxt
JobCompLoc=$LOGDIR/jobcomp.log
# fast turnaround for tests
MinJobAge=300
KillWait=10
InactiveLimit=0
SlurmdTimeout=60
SlurmctldTimeout=60
SlurmctldDebug=info
SlurmdDebug=info
NodeName=${NODE} NodeAddr=127.0.0.1 ${HW} State=UNKNOWN
PartitionName=${PARTITION} Nodes=${NODE} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONFEOF
# slurmd 22.05 always initialises a cgroup plugin (autodetect). On a cgroup-v2-only host without
# systemd/dbus it fails ("cgroup_dbus_attach_to_scope ... slurmd initialization failed");
# IgnoreSystemd makes it build the hierarchy itself (needs a writable /sys/fs/cgroup). UNTESTED here (host is v1).
if [ "$(stat -fc %T /sys/fs/cgroup 2>/dev/null)" = cgroup2fs ] && [ ! -d /run/systemd/system ]; then
  printf 'CgroupPlugin=cgroup/v2\nIgnoreSystemd=yes\nCgroupAutomount=yes\n' > /etc/slurm/cgroup.conf.new
  if ! cmp -s /etc/slurm/cgroup.conf.new /etc/slurm/cgroup.conf; then mv /etc/slurm/cgroup.conf.new /etc/slurm/cgroup.conf; CGROUP_CHANGED=1; else rm -f /etc/slurm/cgroup.conf.new; fi
fi
CONF_CHANGED=${CGROUP_CHANGED:-0}
if ! cmp -s "$CONF.new" "$CONF"; then mv "$CONF.new" "$CONF"; CONF_CHANGED=1; else rm -f "$CONF.new"; fi

# 5. daemons ----------------------------------------------------------------
if [ "$CONF_CHANGED" = 1 ] && running /run/slurmctld.pid; then
  log "config changed: restarting daemons"
  for p in /run/slurmd.pid /run/slurmctld.pid; do running $p && kill "$(cat $p)"; done
  sleep 2
fi
if ! running /run/slurmctld.pid; then
  log "starting slurmctld"
  slurmctld   # daemonizes, writes /run/slurmctld.pid
fi
for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q 'is UP' && break; sleep 0.2; done
scontrol ping | grep -q 'is UP' || { tail -20 $LOGDIR/slurmctld.log; echo "slurmctld did not come up" >&2; exit 1; }
if ! running /run/slurmd.pid; then
  log "starting slurmd"
  slurmd
fi

# 6. wait for the node to be idle ------------------------------------------
for _ in $(seq 120); do
  st=$(sinfo -h -n "$NODE" -o %T 2>/dev/null || true)
  case "$st" in
    idle|mixed|allocated) break ;;
    drain*|down*) scontrol update NodeName="$NODE" State=RESUME 2>/dev/null || true ;;
  esac
  sleep 0.5
done
st=$(sinfo -h -n "$NODE" -o %T)
case "$st" in idle|mixed|allocated) ;; *) sinfo -R; tail -20 $LOGDIR/slurmd.log; echo "node state: $st" >&2; exit 1;; esac
# end-to-end smoke test: a real job step through slurmctld -> slurmd -> slurmstepd
timeout 60 srun -N1 -n1 -t 1 -J dev-cluster-smoke true || { tail -20 $LOGDIR/slurmd.log; echo "smoke srun failed" >&2; exit 1; }
log "cluster up: node $NODE is $st, srun smoke test OK"
sinfo
