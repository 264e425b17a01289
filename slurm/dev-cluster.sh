#!/usr/bin/env bash
# A real Slurm cluster of N compute nodes on one Debian machine, as root, without systemd: for the
# Slurm tests and for trying the launcher (single- and multi-node) locally.
#
#   slurm/dev-cluster.sh up [--nodes N]   install (apt) if needed, configure, start (default N=1);
#                                         idempotent: 0.2 s when up; 3-11 s from stopped (packages
#                                         installed); a different N restarts the daemons (3-17 s)
#   slurm/dev-cluster.sh down [--cancel-jobs]
#                                         stop everything this script started and remove every
#                                         namespace, veth, bridge and /etc/hosts entry it added;
#                                         --cancel-jobs: no job survives (nor the saved state of
#                                         jobs whose daemons died without `down`)
#                                         (~20 s with 4 nodes, most of it MariaDB and slurmdbd)
#   slurm/dev-cluster.sh status           nodes (sinfo -N) and jobs (squeue)
#   slurm/dev-cluster.sh fail-node NODE   a node crash as Slurm sees it: kill NODE's slurmd and
#                                         every process on it (`up` brings it back)
#
# Layout: munge, MariaDB + slurmdbd and slurmctld run in the machine's own namespaces. Every compute
# node node1..nodeN is one slurmd in its own network namespace (veth on the bridge $BRIDGE, address
# $SUBNET.(10+i), no default route: no traffic leaves the bridge), its own UTS namespace (hostname
# nodeI) and its own mount namespace with a private /dev/shm. The filesystem (the venv, run
# directories, /tmp) is the machine's: the "shared filesystem" of the cluster.
#
# Findings behind the settings (measured on this machine kind: gVisor, cgroup v1, Slurm 22.05.8,
# munge 0.5.15; see ../shared/notes/local-slurm/multi-node.md):
# - Separate hostnames are what makes the nodes separate for torch: with `slurmd -N nodeX` alone,
#   Slurm works but every node's hostname is the machine's, it resolves to 127.0.0.1 and a c10d
#   rendezvous across nodes times out. Hence a UTS namespace per slurmd.
# - slurmd is started with `nsenter --net=/run/netns/NODE unshare --uts --mount`, never with
#   `ip netns exec`: that remounts /sys, hides the cgroup v1 mounts and slurmd fails ("Unable to
#   initialize cgroup plugin"). For the same reason per-namespace hosts files (/etc/netns/NODE/hosts,
#   applied only by `ip netns exec`) do not work: the node names go into /etc/hosts between two
#   marker lines that `down` removes.
# - The private /dev/shm (a tmpfs mounted in the node's mount namespace) makes node-local shared
#   memory node-local, and frees it when the node's last process exits: nothing to clean by name.
# - SlurmctldHost must be the machine's `hostname -s` with the bridge address in parentheses
#   (another name: "This host not a valid controller"). slurmctld and the client commands read the
#   config from /etc/slurm/slurm.conf (slurmctld has no -f). One munged serves all nodes (its socket
#   is a file). `%n` works in SlurmdSpoolDir/SlurmdPidFile/SlurmdLogFile; the spool dir must exist.
# - Each slurmd binds port 6818 inside its own namespace: no multiple-slurmd build needed.
# - Accounting (slurmdbd) so that submitit can read job states with sacct; slurmdbd listens on all
#   addresses, so `sacct` works from the nodes too (AccountingStorageHost = the bridge address).
# - cred_expire=10 and a 2 s scheduler interval: a requeued job restarts in ~13 s instead of ~3 min.
# - Node failure: SlurmdTimeout=20 -> a node whose slurmd is gone is `down*` after ~27 s and its
#   job (submitted with --requeue; JobRequeue=1 is the default) is requeued; killing slurmd alone
#   leaves its tasks running, hence `fail-node` kills every process in the namespace. A restarted
#   slurmd returns to service at once (ReturnToService=2).
# - Cleanup pitfalls: deleting a namespace/veth is asynchronous (1-2 s), so `down` deletes veths
#   explicitly and waits; `ip netns add` bind-mounts /run/netns, which `down` unmounts. /etc/hosts
#   is bind-mounted in containers: rewritten in place, never replaced by rename.
# - Measured through it (tests/test_slurm_multinode.py): a 2-node torchrun/gloo job whose ranks
#   report hosts node1,node2; USR2 preemption, requeue and resume across nodes; a node killed
#   mid-run -> down* after ~27 s, job requeued (Restarts=1), resumed after `up`; two jobs on one node;
#   a 4-node job (4 CPU ranks on the 2 cores). vLLM's CPU engine runs inside the namespaces.
# - Shell pitfall: `cmd | grep -q` under pipefail fails at random when grep exits before cmd has
#   written everything (SIGPIPE): match captured output instead.
# - Every node advertises the machine's CPUs and memory (the cluster over-advertises N-fold); node
#   processes share the PID space and /tmp. Job ids restart at 1 when the state is wiped: use a fresh
#   submitit folder per run.
set -euo pipefail

BRIDGE=${SLURM_DEV_BRIDGE:-rhslurm0}
SUBNET=${SLURM_DEV_SUBNET:-10.213.7}       # /24; bridge .1, nodeI .(10+I)
PARTITION=${SLURM_CI_PARTITION:-debug}
# 1 = real accounting (MariaDB + slurmdbd) so `sacct` works (submitit polls sacct); 0 = no DB
ACCOUNTING=${SLURM_CI_ACCOUNTING:-1}
CONF=/etc/slurm/slurm.conf
LOGDIR=/var/log/slurm
HOSTS_BEGIN="# >>> rlhf-hpc dev-cluster nodes >>>"
HOSTS_END="# <<< rlhf-hpc dev-cluster nodes <<<"
export DEBIAN_FRONTEND=noninteractive

t0=$(date +%s)
log() { echo "[dev-cluster +$(( $(date +%s) - t0 ))s] $*"; }
running() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
node_ip() { echo "$SUBNET.$(( 10 + $1 ))"; }
# the nodes that exist now (namespaces this script made), e.g. "node1 node2"
existing_nodes() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^node[0-9]+$' | sort -V || true; }
# word match on captured output: `cmd | grep -q` fails under pipefail when grep exits before cmd
# has written everything (SIGPIPE), which made a re-run's `ip addr add` fail with "already assigned"
has_node() { [[ " $(existing_nodes | xargs) " == *" $1 "* ]]; }
ctld_up() { [[ "$(scontrol ping 2>/dev/null)" == *"is UP"* ]]; }

stop_pid() { # pidfile name
  local f=$1 n=$2 p
  [ -s "$f" ] || return 0
  p=$(cat "$f")
  if kill -0 "$p" 2>/dev/null; then
    kill "$p"
    for _ in $(seq 150); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$p" 2>/dev/null && { echo "$n ($p) did not stop in 15s, SIGKILL"; kill -9 "$p"; }
    echo "$n ($p) stopped"
  fi
  rm -f "$f"
}

# every process on a node (its slurmd, slurmstepds, job tasks): they all live in its net namespace
kill_node_processes() { # node
  local pids
  pids=$(ip netns pids "$1" 2>/dev/null || true)
  [ -n "$pids" ] && kill -9 $pids 2>/dev/null
  for _ in $(seq 50); do [ -z "$(ip netns pids "$1" 2>/dev/null)" ] && break; sleep 0.1; done
  rm -f "/run/slurmd-$1.pid"
}

remove_node() { # node: processes, veth, namespace
  local n=$1
  kill_node_processes "$n"
  ip link del "v${n}" 2>/dev/null || true
  ip netns del "$n" 2>/dev/null || true
  for _ in $(seq 30); do ip link show "v${n}" >/dev/null 2>&1 || break; sleep 0.1; done
}

write_hosts() { # node names (none: remove the block)
  local body="" i
  for n in "$@"; do i=${n#node}; body+="$(node_ip "$i") $n"$'\n'; done
  local rest
  rest=$(awk -v b="$HOSTS_BEGIN" -v e="$HOSTS_END" '$0==b{skip=1;next} $0==e{skip=0;next} !skip' /etc/hosts)
  if [ -n "$body" ]; then
    printf '%s\n%s\n%s%s\n' "$rest" "$HOSTS_BEGIN" "$body" "$HOSTS_END" > /etc/hosts.dev-cluster.new
  else
    printf '%s\n' "$rest" > /etc/hosts.dev-cluster.new
  fi
  cmp -s /etc/hosts.dev-cluster.new /etc/hosts || cat /etc/hosts.dev-cluster.new > /etc/hosts  # in place
  rm -f /etc/hosts.dev-cluster.new
}

start_slurmd() { # node
  local n=$1
  install -d -m 0755 "/var/spool/slurmd/$n"
  # own UTS (hostname) and mount namespace (private /dev/shm) inside the node's network namespace;
  # setsid + redirects: fully detached from the caller's shell
  setsid nsenter --net="/run/netns/$n" unshare --uts --mount --propagation private \
    sh -c "hostname $n && mount -t tmpfs -o mode=1777,size=4g tmpfs /dev/shm && exec slurmd -N $n" \
    </dev/null >/dev/null 2>&1
  for _ in $(seq 50); do running "/run/slurmd-$n.pid" && break; sleep 0.1; done
  running "/run/slurmd-$n.pid" || { tail -20 "$LOGDIR/slurmd-$n.log" 2>/dev/null; echo "slurmd on $n did not start" >&2; exit 1; }
}

cmd=${1:-up}
shift || true
case "$cmd" in
  up)
    NODES=1
    while [ $# -gt 0 ]; do
      case "$1" in
        --nodes) NODES=${2:?--nodes needs a number}; shift 2 ;;
        --nodes=*) NODES=${1#--nodes=}; shift ;;
        *) echo "up: unknown option $1 (usage: $0 up [--nodes N])" >&2; exit 2 ;;
      esac
    done
    [[ "$NODES" =~ ^[1-9][0-9]?$ ]] && [ "$NODES" -le 64 ] || { echo "--nodes: 1..64, got '$NODES'" >&2; exit 2; } ;;
  down)
    set +e
    if [ "${1:-}" = "--cancel-jobs" ]; then
      if running /run/slurmctld.pid; then
        scancel --user=root 2>/dev/null; sleep 3
      else
        # no controller to cancel with (the daemons died with the machine's session): the saved job
        # state goes instead; a cold slurmctld would recover those jobs as running, hold their nodes
        # and requeue them (--requeue), long after their processes are gone
        rm -f /var/spool/slurmctld/job_state /var/spool/slurmctld/job_state.old
        rm -rf /var/spool/slurmctld/hash.* /var/spool/slurmd/*/job[0-9]* /var/spool/slurmd/*/cred_state* \
          /var/spool/slurmd/*/hwloc_topo_[0-9]* /var/spool/slurmd/*/node*_[0-9]*
        echo "saved job state removed"
      fi
    fi
    for n in $(existing_nodes); do
      stop_pid "/run/slurmd-$n.pid" "slurmd on $n"
      remove_node "$n"
      echo "node $n removed"
    done
    stop_pid /run/slurmd.pid slurmd   # a single-node cluster of an older version of this script
    stop_pid /run/slurmctld.pid slurmctld
    stop_pid /run/slurmdbd.pid slurmdbd
    stop_pid /run/mysqld/mysqld.pid mariadbd
    stop_pid /run/munge/munged.pid munged
    if ip link show "$BRIDGE" >/dev/null 2>&1; then ip link del "$BRIDGE"; echo "bridge $BRIDGE removed"; fi
    write_hosts
    # `ip netns add` made /run/netns a mount point: undo it once no namespace is left
    if [ -z "$(ip netns list 2>/dev/null)" ] && mountpoint -q /run/netns 2>/dev/null; then umount /run/netns; fi
    exit 0 ;;
  status)
    sinfo -N -o '%N %T %c %m %E' 2>/dev/null || echo "slurmctld is not answering"
    squeue -o '%.8i %.12j %.9T %.6D %.10M %R' 2>/dev/null
    exit 0 ;;
  fail-node)
    n=${1:?usage: $0 fail-node NODE}
    has_node "$n" || { echo "no node $n" >&2; exit 2; }
    kill_node_processes "$n"
    log "node $n failed: slurmd and all its processes killed (bring it back with: $0 up --nodes N)"
    exit 0 ;;
  *) echo "usage: $0 up [--nodes N] | down [--cancel-jobs] | status | fail-node NODE" >&2; exit 2 ;;
esac

HOST=$(hostname -s)
BRIDGE_IP="$SUBNET.1"
NODE_NAMES=$(for i in $(seq "$NODES"); do echo "node$i"; done)

# 1. packages ---------------------------------------------------------------
PKGS="slurmctld slurmd slurm-client munge iproute2 util-linux"
[ "$ACCOUNTING" = 1 ] && PKGS="$PKGS slurmdbd mariadb-server"
MISSING=$(for p in $PKGS; do [[ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" == *"ok installed"* ]] || echo "$p"; done)
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

# 2. network: bridge, one namespace per node, names in /etc/hosts -------------
if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
  ip link add "$BRIDGE" type bridge
fi
[[ "$(ip -4 addr show dev "$BRIDGE")" == *"inet $BRIDGE_IP/24"* ]] || ip addr add "$BRIDGE_IP/24" dev "$BRIDGE"
ip link set "$BRIDGE" up
for n in $(existing_nodes); do  # fewer nodes than before: remove the extra ones
  i=${n#node}
  if [ "$i" -gt "$NODES" ]; then
    scontrol update NodeName="$n" State=DOWN Reason=removed 2>/dev/null || true
    stop_pid "/run/slurmd-$n.pid" "slurmd on $n"; remove_node "$n"; log "node $n removed"
  fi
done
for i in $(seq "$NODES"); do
  n=node$i
  if ! has_node "$n"; then
    ip link del "v$n" 2>/dev/null || true  # a veth left over by an interrupted run
    ip netns add "$n"
    ip link add "v$n" type veth peer name eth0 netns "$n"
    ip link set "v$n" master "$BRIDGE" up
    ip -n "$n" addr add "$(node_ip "$i")/24" dev eth0
    ip -n "$n" link set eth0 up
    ip -n "$n" link set lo up
    log "node $n: namespace, $(node_ip "$i") on $BRIDGE"
  fi
done
# shellcheck disable=SC2086
write_hosts $NODE_NAMES

# 3. munge ------------------------------------------------------------------
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

# 4. accounting DB (optional) ------------------------------------------------
if [ "$ACCOUNTING" = 1 ]; then
  install -d -o mysql -g mysql -m 0755 /run/mysqld
  install -d -m 0755 "$LOGDIR"
  [ -d /var/lib/mysql/mysql ] || mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
  if ! mariadb -e 'select 1' >/dev/null 2>&1; then
    log "starting mariadbd"
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
AccountingStorageHost=$BRIDGE_IP
AccountingStoragePort=6819"
else
  ACCT_LINES="AccountingStorageType=accounting_storage/none"
fi

# 5. slurm.conf -------------------------------------------------------------
install -d -m 0755 /etc/slurm "$LOGDIR" /var/spool/slurmctld /var/spool/slurmd
# CPUs/sockets/cores/memory exactly as slurmd detects them (avoids the nodes being drained)
HW=$(slurmd -C | head -1 | sed -e 's/^NodeName=[^ ]* //')
NODE_LINES=$(for i in $(seq "$NODES"); do echo "NodeName=node$i NodeAddr=$(node_ip "$i") $HW State=UNKNOWN"; done)
cat > "$CONF.new" <<CONFEOF
ClusterName=ci
SlurmctldHost=${HOST}(${BRIDGE_IP})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued job waits before it may start again (default 120 s)
AuthInfo=cred_expire=10
MpiDefault=none
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=$LOGDIR/slurmctld.log
SlurmdLogFile=$LOGDIR/slurmd-%n.log
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
# a job submitted with --requeue goes back to the queue when one of its nodes fails (1 is the default)
JobRequeue=1
# a node whose slurmd comes back is usable again at once
ReturnToService=2
${ACCT_LINES}
# plain-text completion log (readable with: sacct --completion, even without slurmdbd)
JobCompType=jobcomp/filetxt
JobCompLoc=$LOGDIR/jobcomp.log
# fast turnaround for tests
MinJobAge=300
KillWait=10
InactiveLimit=0
# a node not answering for 20 s is down (its jobs requeue or fail)
SlurmdTimeout=20
SlurmctldTimeout=60
SlurmctldDebug=info
SlurmdDebug=info
${NODE_LINES}
PartitionName=${PARTITION} Nodes=node[1-${NODES}] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
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

# 6. daemons ----------------------------------------------------------------
if [ "$CONF_CHANGED" = 1 ]; then
  # node set or settings changed: every daemon must read the new file
  for n in $NODE_NAMES; do running "/run/slurmd-$n.pid" && { log "config changed: stopping slurmd on $n"; stop_pid "/run/slurmd-$n.pid" "slurmd on $n"; }; done
  running /run/slurmd.pid && stop_pid /run/slurmd.pid "slurmd (single-node layout)"
  running /run/slurmctld.pid && { log "config changed: restarting slurmctld"; stop_pid /run/slurmctld.pid slurmctld; }
fi
if ! running /run/slurmctld.pid; then
  log "starting slurmctld"
  slurmctld   # daemonizes, writes /run/slurmctld.pid
fi
for _ in $(seq 100); do ctld_up && break; sleep 0.2; done
ctld_up || { tail -20 $LOGDIR/slurmctld.log; echo "slurmctld did not come up" >&2; exit 1; }
for n in $NODE_NAMES; do
  if ! running "/run/slurmd-$n.pid"; then
    kill_node_processes "$n"  # what a failed node left behind
    log "starting slurmd on $n"
    start_slurmd "$n"
  fi
done

# 7. wait for the nodes to be idle --------------------------------------------
for _ in $(seq 120); do
  bad=0
  for n in $NODE_NAMES; do
    st=$(sinfo -h -n "$n" -o %T 2>/dev/null || true)
    case "$st" in
      idle|mixed|allocated|completing) ;;
      drain*|down*) bad=1; scontrol update NodeName="$n" State=RESUME 2>/dev/null || true ;;
      *) bad=1 ;;
    esac
  done
  [ "$bad" = 0 ] && break
  sleep 0.5
done
[ "$bad" = 0 ] || { sinfo -N -R; for n in $NODE_NAMES; do tail -5 "$LOGDIR/slurmd-$n.log"; done; echo "nodes not ready" >&2; exit 1; }
# end-to-end smoke test: one job step on every node through slurmctld -> slurmd -> slurmstepd; each
# node must report its own hostname
SEEN=$(timeout 60 srun -N"$NODES" -n"$NODES" --ntasks-per-node=1 -t 1 -J dev-cluster-smoke hostname | sort -V | xargs) \
  || { for n in $NODE_NAMES; do tail -5 "$LOGDIR/slurmd-$n.log"; done; squeue
       echo "smoke srun failed (jobs left from a previous run? bash $0 down --cancel-jobs)" >&2; exit 1; }
[ "$SEEN" = "$(echo $NODE_NAMES)" ] || { echo "smoke srun: hosts '$SEEN', expected '$(echo $NODE_NAMES)'" >&2; exit 1; }
log "cluster up: $NODES node(s) ($SEEN) idle, srun smoke test OK"
sinfo
