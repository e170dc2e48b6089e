#!/usr/bin/env bash
# Test hosts on one machine, for runs across nodes without a cluster (as root).
#
# Each host is a network namespace with its own hostname (entered through a new UTS
# namespace by netns-rsh.sh) and its own share of the cores (a cpuset its processes are
# pinned to), joined to the others by a veth link on a bridge. The addresses are a
# private /24 used on these links alone; nothing outside them is ever contacted. Open MPI
# starts its daemons on them with plm_rsh_agent=netns-rsh.sh, sees one node per host and
# moves messages between them over TCP: no shared memory and no CMA across hosts.
#
# Usage: hosts.sh up N          N hosts (idempotent: an existing set is reused or grown)
#        hosts.sh down          remove every host, link and the bridge
#        hosts.sh shape RATE    shape every host's link to RATE each way (tc tbf: 1gbit, 500mbit)
#        hosts.sh unshape       remove the shaping
#        hosts.sh link HOST up|down   take one host's link down (a lost node) or up again
#        hosts.sh kill HOST     kill every process in HOST (a crashed node)
#        hosts.sh names         the hosts, one per line
#        hosts.sh mpirun-args   Open MPI options for runs on these hosts (one per line): the
#                               agent, TCP on these links alone, no binding (each host's
#                               cpuset binds), and TCP keepalives on mpirun's links to its
#                               daemons, so that mpirun notices a lost host in ~3 s: about as
#                               mpipe names it (--p2p-timeout 3 in the tests), before
#                               mpipe's abort 3 s later (by default it takes ~8 minutes,
#                               and once an abort has sent it data for that host, TCP's
#                               retransmissions rule instead: ~15 minutes)
# Environment: MPIPE_HOSTS_PREFIX (mpn: hosts mpn1, mpn2, ...), MPIPE_HOSTS_NET (10.213.0).
set -euo pipefail
prefix=${MPIPE_HOSTS_PREFIX:-mpn}
net=${MPIPE_HOSTS_NET:-10.213.0}
bridge=${prefix}br0
state=/run/mpipe-hosts/$prefix
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

die() { echo "hosts.sh: $*" >&2; exit 2; }
[[ $(id -u) == 0 ]] || die "needs root (network namespaces); run as root or skip the multinode tests"
command -v ip >/dev/null || die "needs iproute2 (apt-get install iproute2)"

names() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${prefix}[0-9]+$" | sort -V || true; }

up() {
  local n=$1 cores i h veth first per
  [[ $n =~ ^[0-9]+$ && $n -ge 1 && $n -le 200 ]] || die "up N: N from 1 to 200, got '$n'"
  mkdir -p "$state"
  ip link show "$bridge" >/dev/null 2>&1 || ip link add "$bridge" type bridge
  # (Tests on the text, not grep -q in a pipe: under pipefail its early exit fails the pipe.)
  [[ $(ip addr show dev "$bridge") == *"inet $net.254/"* ]] || ip addr add "$net.254/24" dev "$bridge"
  ip link set "$bridge" up
  # Bridged frames skip the host's packet filter (br_netfilter), as a switch would; the
  # setting is the machine's, kept and given back by down.
  local nf=/proc/sys/net/bridge/bridge-nf-call-iptables
  if [[ -w $nf && ! -e $state/bridge-nf-call-iptables ]]; then
    cat "$nf" > "$state/bridge-nf-call-iptables"
    echo 0 > "$nf" || true
  fi
  cores=$(nproc --all)
  for ((i = 1; i <= n; i++)); do
    h=$prefix$i veth=${prefix}v$i
    [[ -e /run/netns/$h ]] || ip netns add "$h"
    if ! ip link show "$veth" >/dev/null 2>&1; then
      ip -n "$h" link del eth0 2>/dev/null || true
      ip link add "$veth" type veth peer name eth0 netns "$h"
    fi
    ip link set "$veth" master "$bridge" up
    [[ $(ip -n "$h" addr show dev eth0) == *"inet $net.$i/"* ]] || ip -n "$h" addr add "$net.$i/24" dev eth0
    ip -n "$h" link set eth0 up
    ip -n "$h" link set lo up
    # Its share of the cores: a block of cores/n each, or, with more hosts than cores, one
    # core taken round-robin (the hosts then share cores, as oversubscribed ranks do).
    if ((n <= cores)); then
      per=$((cores / n)); first=$(((i - 1) * per))
      echo "$first-$((first + per - 1))" > "$state/$h.cpus"
    else
      echo "$(((i - 1) % cores))" > "$state/$h.cpus"
    fi
  done
  # Wait until each host answers on its address from the bridge (the link is up).
  for ((i = 1; i <= n; i++)); do
    for _ in $(seq 50); do
      ip neigh show dev "$bridge" >/dev/null
      [[ $(ip -n "$prefix$i" link show dev eth0) == *LOWER_UP* ]] && break
      sleep 0.1
    done
  done
}

down() {
  local h
  for h in $(names); do
    ip netns pids "$h" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip link del "${h/$prefix/${prefix}v}" 2>/dev/null || true
    ip netns del "$h" 2>/dev/null || true
  done
  ip link del "$bridge" 2>/dev/null || true
  local nf=/proc/sys/net/bridge/bridge-nf-call-iptables
  [[ -f $state/bridge-nf-call-iptables && -w $nf ]] && { cat "$state/bridge-nf-call-iptables" > "$nf" || true; }
  rm -rf "$state"
}

shape() {
  local rate=$1 h
  [[ $rate =~ ^[0-9]+(k|m|g)?bit$ ]] || die "shape RATE: e.g. 1gbit or 500mbit, got '$rate'"
  for h in $(names); do
    # Both ways: the host's egress on its eth0, its ingress on the bridge side of the veth.
    # tbf: a bucket of 1 ms at the rate (at least 64 KiB), at most 20 ms of queue.
    for dev in "ip netns exec $h tc qdisc replace dev eth0" "tc qdisc replace dev ${h/$prefix/${prefix}v}"; do
      $dev root tbf rate "$rate" burst 256kbit latency 20ms
    done
  done
}

unshape() {
  local h
  for h in $(names); do
    ip netns exec "$h" tc qdisc del dev eth0 root 2>/dev/null || true
    tc qdisc del dev "${h/$prefix/${prefix}v}" root 2>/dev/null || true
  done
}

case ${1:-} in
  up) up "${2:-2}" ;;
  down) down ;;
  shape) shape "${2:?shape RATE}" ;;
  unshape) unshape ;;
  link)
    h=${2:?link HOST up|down}
    [[ ${3:-} == up || ${3:-} == down ]] || die "link HOST up|down"
    ip link set "${h/$prefix/${prefix}v}" "$3" ;;
  kill) ip netns pids "${2:?kill HOST}" | xargs -r kill -9 2>/dev/null || true ;;  # some may end first
  names) names ;;
  mpirun-args)
    printf '%s\n' --bind-to none --mca plm_rsh_agent "$here/netns-rsh.sh" --mca plm_rsh_no_tree_spawn 1 \
      --mca oob_tcp_if_include "$net.0/24" --mca btl_tcp_if_include "$net.0/24" \
      --mca oob_tcp_keepalive_time 1 --mca oob_tcp_keepalive_intvl 1 --mca oob_tcp_keepalive_probes 2 ;;
  *) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
