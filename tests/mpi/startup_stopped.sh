#!/usr/bin/env bash
# A rank stopped (SIGSTOP) in each phase of start-up, rank 0 and another in turn: the job
# must end within --p2p-timeout + 3 s, non-zero, with exactly one error line that names
# the stopped rank and the phase. MPIPE_FAULT_STOP=PHASE@RANK has that rank stop itself
# as it enters PHASE (without the start-up watchdog the others waited in a collective for
# ever; before the watchdog, in MPI_Init and the first collective, the start-up deadline
# names it: app/startup.hpp). A checkpoint from a first run makes "resume" read one.
# Then a rank of a D=2 x K=2 job stopped from outside at moments of its start-up (0.1 to
# 1.2 s after the launch, wherever that falls): named, within --p2p-timeout + 5 s of the stop.
# Usage: startup_stopped.sh MPIPE
set -u
mpipe=$1
timeout=2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
model=(train --layers 2 --d-model 32 --heads 2 --seq-len 16 --batch-size 4 --threads 1 --vocab 256 --micro-batches 2
       --p2p-timeout "$timeout" --checkpoint-dir "$work/d")
fail() { printf 'FAIL: %s\n%s\n' "$1" "${2:-}"; exit 1; }
out=$(mpiexec -n 2 --oversubscribe "$mpipe" "${model[@]}" --steps 2 2>&1) || fail "the first run failed" "$out"
victim=0
for phase in MPI_Init hosts options directory lock device resolve measure executor connect allocate resume claim; do
  extra=()
  [[ $phase == measure ]] && extra=(--partition time)  # the only run that measures
  start=$(date +%s.%N)
  out=$(MPIPE_FAULT_STOP="$phase@$victim" timeout 60 mpiexec -n 2 --oversubscribe "$mpipe" "${model[@]}" --steps 4 \
        "${extra[@]}" 2>&1)
  rc=$?
  took=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  what="rank $victim stopped in $phase: exit $rc after $took s"
  [[ $rc -ne 0 && $rc -ne 124 ]] || fail "$what (0: no stop; 124: a hang)" "$out"
  awk -v t="$took" -v limit="$timeout" 'BEGIN { exit !(t <= limit + 3) }' || fail "$what: too slow" "$out"
  [[ $(grep -c "mpipe: error" <<<"$out") -eq 1 ]] || fail "$what: not exactly one error line" "$out"
  grep -Eq "mpipe: error: rank $victim stopped answering .*start-up \($phase\)" <<<"$out" \
    || fail "$what: the line names another rank or phase" "$out"
  echo "$what: $(grep "mpipe: error" <<<"$out" | cut -c1-160)"
  victim=$((1 - victim))
done
# From outside, as a user or a node's trouble would: SIGSTOP to world rank 1 or 3.
pid_of() {
  for p in $(pgrep -f "$mpipe train"); do
    tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$1" && echo "$p" && return
  done
}
victim=1
for delay in 0.1 0.3 0.5 0.8 1.2; do
  start=$(date +%s.%N)
  timeout 60 mpiexec -n 4 --oversubscribe "$mpipe" "${model[@]}" --steps 200 --replicas 2 --batch-size 8 > "$work/out" 2>&1 &
  job=$!
  pid=""
  until [[ -n $pid ]] || ! kill -0 "$job" 2>/dev/null; do pid=$(pid_of "$victim"); [[ -n $pid ]] || sleep 0.01; done
  [[ -n $pid ]] || fail "rank $victim never started" "$(cat "$work/out")"
  sleep "$(awk -v d="$delay" -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { s = d - (b - a); print (s > 0 ? s : 0) }')"
  kill -STOP "$pid"
  stopped=$(date +%s.%N)
  wait "$job"; rc=$?
  took=$(awk -v a="$stopped" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  out=$(cat "$work/out")
  what="rank $victim stopped from outside ${delay} s after launch: exit $rc, ended $took s after the stop"
  [[ $rc -ne 0 && $rc -ne 124 ]] || fail "$what (0: the stop missed; 124: a hang)" "$out"
  awk -v t="$took" -v limit="$timeout" 'BEGIN { exit !(t <= limit + 5) }' || fail "$what: too slow" "$out"
  [[ $(grep -c "mpipe: error" <<<"$out") -eq 1 ]] || fail "$what: not exactly one error line" "$out"
  grep -Eq "mpipe: error: (rank|ranks) $victim[ ,].*stopped answering" <<<"$out" || fail "$what: the line names another rank" "$out"
  echo "$what: $(grep "mpipe: error" <<<"$out" | cut -c1-160)"
  victim=$((4 - victim))
done
