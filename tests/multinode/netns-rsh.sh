#!/usr/bin/env bash
# Open MPI's remote shell for the test hosts of hosts.sh (plm_rsh_agent):
#   netns-rsh.sh HOST CMD...
# Enters HOST's network namespace with its own hostname (a new UTS namespace), pinned to
# HOST's cores (its cpuset, so each host's daemon binds ranks to cores of its own), and
# runs CMD through a shell, as ssh would on a real node. MPIPE_HOSTS_NO_PIN=1: no cpuset
# (every host sees all cores, as a node does).
host=$1; shift
pin=()
for f in /run/mpipe-hosts/*/"$host".cpus; do
  [[ -f $f && -z ${MPIPE_HOSTS_NO_PIN:-} ]] && pin=(taskset -c "$(cat "$f")")
done
exec ip netns exec "$host" "${pin[@]}" unshare --uts /bin/sh -c 'hostname "$0"; exec /bin/sh -c "$1"' "$host" "$*"
