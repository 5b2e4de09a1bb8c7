#!/usr/bin/env bash
# Data-parallel training across several "hosts" on one machine (issue 53, part 3): each host
# is a Linux network namespace with its own address and hostname, all joined to one bridge
# (in a namespace of its own, so the machine's own network is untouched); Open MPI starts
# one rank per host over TCP, from a hostfile naming the addresses, through a remote-launch
# agent that enters the host's namespace where a cluster would ssh. Prints the run's
# communication per step (what `hemi train` reports: MB sent, messages, ms waiting) and
# removes every namespace again, also on failure or Ctrl-C. Needs root (or CAP_NET_ADMIN and
# CAP_SYS_ADMIN), iproute2 and Open MPI.
#
#   cargo build --release -p hemi-cli --features mpi
#   sudo bench/multihost.sh [--hosts N] [--hemi PATH] [--epochs E] [--vanish] [-- hemi train args]
#
# --hosts N     hosts (namespaces), one rank each (default 2)
# --hemi PATH   the hemi binary, built with `--features mpi` (default $HEMI, else
#               target/release/hemi)
# --epochs E    epochs to train (default 1)
# --vanish      after the first checkpoint, take the last host's link down (the host vanishes
#               from the network mid-step) and report how long the job took to end; the run
#               uses --dist-timeout 5 unless the extra arguments set one
# After `--`: more `hemi train` arguments (default: the MLP on 8192 synthetic images, batch 32
# per rank, one thread per rank).
#
# Knobs: HEMI_NETNS_PREFIX (namespace names, default hemi-mh), HEMI_NETNS_SUBNET (the first
# three octets, default 10.78.0), HEMI_TCP_RETRIES2 (the hosts' net.ipv4.tcp_retries2,
# default 4; see below), HEMI_NETNS_MTU (the links' MTU, default Ethernet's 1500),
# MPIRUN_ARGS (more mpirun flags), KEEP=1 (keep the work directory, printed).
# Exit status: that of mpirun (0: trained; with --vanish, 0 when the job ended with an error
# naming the vanished host within the timeout plus 20 s); 2 for a refusal (not root, no `ip
# netns`, no mpirun, no hemi binary).

set -euo pipefail
cd "$(dirname "$0")/.."

hosts=2
hemi=${HEMI:-target/release/hemi}
epochs=1
vanish=0
extra=()
while [ $# -gt 0 ]; do
    case "$1" in
        --hosts) hosts=$2; shift 2 ;;
        --hemi) hemi=$2; shift 2 ;;
        --epochs) epochs=$2; shift 2 ;;
        --vanish) vanish=1; shift ;;
        --) shift; extra=("$@"); break ;;
        -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
        *) echo "multihost.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

refuse() { echo "multihost.sh: $*" >&2; exit 2; }
[ "$(id -u)" = 0 ] || refuse "needs root: network namespaces and veth pairs need CAP_NET_ADMIN (run it with sudo)"
command -v ip >/dev/null || refuse "no \`ip\` command: install iproute2 (apt-get install iproute2)"
ip netns list >/dev/null 2>&1 || refuse "\`ip netns\` does not work here (no network-namespace support?)"
command -v mpirun >/dev/null || refuse "no mpirun: install Open MPI (apt-get install openmpi-bin libopenmpi-dev)"
command -v unshare >/dev/null || refuse "no unshare (util-linux): needed to give each host its own hostname"
case "$hosts" in ''|*[!0-9]*) refuse "--hosts $hosts: expected a number from 2 to 200" ;; esac
[ "$hosts" -ge 2 ] && [ "$hosts" -le 200 ] || refuse "--hosts $hosts: expected a number from 2 to 200"
[ -x "$hemi" ] || refuse "no hemi binary at $hemi: build it with \`cargo build --release -p hemi-cli --features mpi\` or pass --hemi PATH"
hemi=$(realpath "$hemi")

prefix=${HEMI_NETNS_PREFIX:-hemi-mh}
subnet=${HEMI_NETNS_SUBNET:-10.78.0}
sw="$prefix-sw"
for ns in "$sw" $(seq -f "$prefix%g" 0 $((hosts - 1))); do
    if ip netns list | grep -qw "$ns"; then
        refuse "network namespace $ns exists already (another run? remove it with \`ip netns del $ns\`)"
    fi
done
work=$(mktemp -d /tmp/hemi-multihost.XXXXXX)

cleanup() {
    local rc=$?
    for ns in $(seq -f "$prefix%g" 0 $((hosts - 1))) "$sw"; do
        if ip netns list | grep -qw "$ns"; then
            # Whatever still runs in a host (a rank or orted left behind by a failure) first.
            pids=$(ip netns pids "$ns" 2>/dev/null || true)
            [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
            ip netns del "$ns" 2>/dev/null || true
        fi
    done
    if [ "${KEEP:-0}" = 1 ]; then
        echo "kept $work" >&2
    else
        rm -rf "$work"
    fi
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# The switch: a bridge in a namespace of its own; host i: eth0 at $subnet.(i+1), a veth
# pair whose other end is a port of the bridge.
ip netns add "$sw"
ip -n "$sw" link add br0 type bridge
ip -n "$sw" link set br0 up
hostfile="$work/hostfile"
: > "$hostfile"
# How many times a host's TCP retransmits unacknowledged data before it gives the connection
# up: Linux's default, 15, is about 15 minutes at the 200 ms minimum RTO; 4 is about 6 s.
# It bounds how long mpirun waits for the daemon of a vanished host once the job is
# aborting (Open MPI then only notices the loss when a send to it fails).
retries2=${HEMI_TCP_RETRIES2:-4}
mtu=${HEMI_NETNS_MTU:-1500}
for i in $(seq 0 $((hosts - 1))); do
    ns="$prefix$i"
    ip netns add "$ns"
    ip -n "$sw" link add "p$i" type veth peer name eth0 netns "$ns"
    ip -n "$sw" link set "p$i" master br0
    ip -n "$sw" link set "p$i" mtu "$mtu" up
    ip -n "$ns" link set eth0 mtu "$mtu"
    ip -n "$ns" addr add "$subnet.$((i + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    ip netns exec "$ns" sh -c "echo $retries2 > /proc/sys/net/ipv4/tcp_retries2"
    echo "$subnet.$((i + 1)) slots=1" >> "$hostfile"
done

# Open MPI's remote-launch agent (plm_rsh_agent, ssh on a cluster): `agent HOST CMD…` runs
# CMD on HOST; here HOST's last octet names the namespace, and a UTS namespace of its own
# gives the host its own hostname.
agent="$work/netns-rsh"
cat > "$agent" <<EOF
#!/bin/sh
host=\$1; shift
n=\${host##*.}
exec ip netns exec "$prefix\$((n - 1))" unshare --uts sh -c "hostname $prefix-host\$((n - 1)); \$*"
EOF
chmod +x "$agent"

ckpt="$work/ck"
if [ ${#extra[@]} -eq 0 ]; then
    extra=(--model mlp --dataset synthetic --synthetic-size 8192 --batch-size 32 --threads 1
        --workers 1 --lr 0.05)
fi
timeout_args=()
if [ "$vanish" = 1 ] && ! printf '%s\n' "${extra[@]}" | grep -q -- '^--dist-timeout'; then
    timeout_args=(--dist-timeout 5)
fi
args=(train "${extra[@]}" --epochs "$epochs" --checkpoint-dir "$ckpt" "${timeout_args[@]}")
if [ "$vanish" = 1 ] && [ "$epochs" -lt 3 ]; then
    args=(train "${extra[@]}" --epochs 50 --checkpoint-dir "$ckpt" "${timeout_args[@]}")
fi

# TCP only (btl self,tcp: no shared memory between "hosts"), on the hosts' subnet for both
# MPI's messages (btl_tcp_if_include) and its runtime's (oob_tcp_if_include).
# --bind-to none: each host's daemon would bind its rank to its core 0, and here all hosts'
# core 0 is the same core.
mpi=(mpirun --hostfile "$hostfile" -np "$hosts" --map-by node --bind-to none
    --mca plm_rsh_agent "$agent"
    --mca btl self,tcp --mca btl_tcp_if_include "$subnet.0/24"
    --mca oob_tcp_if_include "$subnet.0/24"
    ${MPIRUN_ARGS:-}
    "$hemi" "${args[@]}")
quoted=$(printf "'%s' " "${mpi[@]}")
echo "hosts: $(tr '\n' ' ' < "$hostfile")"
echo "mpirun in $prefix-host0: ${mpi[*]}"
log="$work/log"
start=$(date +%s.%N)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
set +e
ip netns exec "${prefix}0" unshare --uts sh -c "hostname $prefix-host0; exec $quoted" \
    > >(tee "$log") 2> >(tee "$log.err" >&2) &
job=$!
if [ "$vanish" = 1 ]; then
    last=$((hosts - 1))
    while [ ! -e "$ckpt/epoch-0001/model.safetensors" ] && kill -0 "$job" 2>/dev/null; do
        sleep 0.1
    done
    sleep 0.5
    cut=$(date +%s.%N)
    ip -n "$prefix$last" link set eth0 down
    echo "cut $prefix-host$last ($subnet.$hosts) off the network" >&2
fi
wait "$job"
rc=$?
set -e
end=$(date +%s.%N)
sleep 0.2 # the tees
echo "mpirun exited with $rc after $(echo "$end - $start" | bc) s"
if [ "$vanish" = 1 ]; then
    took=$(echo "$end - $cut" | bc)
    echo "the job ended $took s after host $prefix-host$last vanished"
    newest=$(ls -d "$ckpt"/epoch-* 2>/dev/null | tail -1)
    echo "newest complete checkpoint: ${newest:-none}"
    limit=$(printf '%s\n' "${args[@]}" | grep -A1 -- '^--dist-timeout' | tail -1)
    if [ "$rc" != 0 ] && grep -q "host $prefix-host$last" "$log.err" \
        && [ "$(echo "$took < $limit + 20" | bc)" = 1 ] && [ -n "$newest" ] \
        && "$hemi" eval --checkpoint "$ckpt" > "$work/eval" 2>&1; then
        echo "vanish: ok (ended with an error naming the host, within --dist-timeout $limit s + 20 s; the checkpoint loads)"
        exit 0
    fi
    echo "vanish: FAILED" >&2
    exit 1
fi
echo "== the run (rank 0) =="
grep -E "^hosts:|^communication|^summary|ranks x batch" "$log" || true
exit $rc
