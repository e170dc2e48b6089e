#!/usr/bin/env bash
# Runs stopped_rank with each victim given: the job must end (non-zero) within the
# timeout + 2 s, with exactly one error line, naming the stopped rank. (A stopped rank 0
# is named once its heartbeats have been silent for the timeout: 2.7 s at a timeout of 2;
# a roll call that sat out its grace as well took 4.7 s.)
# A victim given as V/W has rank W wait for a word from V first (the stage after a stopped
# one): W misses the rendezvous too, its heartbeats going on, and is not named.
# Usage: stopped_rank.sh BINARY RANKS TIMEOUT_S VICTIM[/WAITER]...
set -u
binary=$1 ranks=$2 timeout=$3
shift 3
for spec in "$@"; do
  victim=${spec%%/*} waiter=()
  [[ $spec == */* ]] && waiter=("${spec#*/}")
  start=$(date +%s.%N)
  out=$(timeout 60 mpiexec -n "$ranks" --oversubscribe "$binary" "$victim" "$timeout" "${waiter[@]}" 2>&1)
  rc=$?
  took=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  fail() { printf 'FAIL: victim %s: %s (exit %s after %s s)\n%s\n' "$victim" "$1" "$rc" "$took" "$out"; exit 1; }
  [[ $rc -ne 0 ]] || fail "the job exited 0"
  awk -v t="$took" -v limit="$timeout" 'BEGIN { exit !(t <= limit + 2) }' || fail "too slow"
  [[ $(grep -c "mpipe: error" <<<"$out") -eq 1 ]] || fail "not exactly one error line"
  grep -Eq "mpipe: error: rank $victim (stopped answering|did not reach)" <<<"$out" || fail "the line names another rank"
  echo "victim $spec: ended in $took s: $(grep "mpipe: error" <<<"$out" | cut -c1-150)"
done
