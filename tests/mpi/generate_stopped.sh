#!/usr/bin/env bash
# `mpipe generate` over 3 ranks with one of them stopped (SIGSTOP) mid-generation, each
# rank in turn: as in train, the job must end (non-zero) within --p2p-timeout + 5 s of the
# stop, with exactly one error line, naming the stopped rank. Before the watchdog it hung
# for ever in a blocking MPI call (issue 64, group B). And a run that nothing stops ends 0.
# Usage: generate_stopped.sh MPIPE
set -u
mpipe=$1
timeout=2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { printf 'FAIL: %s\n%s\n' "$1" "${2:-}"; exit 1; }
"$mpipe" train --model gpt --layers 2 --d-model 16 --heads 2 --seq-len 16 --vocab 256 --batch-size 2 --micro-batches 1 \
  --steps 2 --threads 1 --checkpoint-dir "$work/run" >/dev/null 2>&1 || fail "the training run failed"
generate=(generate --checkpoint "$work/run" --prompt hi --threads 1 --p2p-timeout "$timeout")
out=$(timeout 60 mpiexec -n 3 --oversubscribe "$mpipe" "${generate[@]}" --tokens 40 2>&1 >/dev/null) || fail "a plain run failed" "$out"
grep -q "mpipe: generated 40 tokens" <<<"$out" || fail "a plain run did not generate" "$out"
pid_of() {
  for p in $(pgrep -f "$mpipe generate"); do
    tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$1" && echo "$p" && return
  done
}
for victim in 1 2 0; do
  timeout 90 mpiexec -n 3 --oversubscribe "$mpipe" "${generate[@]}" --tokens 100000000 > /dev/null 2> "$work/err" &
  job=$!
  # Generating: the start line is out (the load is done), then a little more.
  until grep -q "mpipe: generating from" "$work/err" || ! kill -0 "$job" 2>/dev/null; do sleep 0.1; done
  sleep 1
  pid=$(pid_of "$victim")
  [[ -n $pid ]] || fail "rank $victim not found" "$(cat "$work/err")"
  kill -STOP "$pid"
  stopped=$(date +%s.%N)
  wait "$job"; rc=$?
  kill -CONT "$pid" 2>/dev/null
  took=$(awk -v a="$stopped" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  out=$(cat "$work/err")
  what="rank $victim stopped while generating: exit $rc, ended $took s after the stop"
  [[ $rc -ne 0 && $rc -ne 124 ]] || fail "$what (0: the stop missed; 124: a hang)" "$out"
  awk -v t="$took" -v limit="$timeout" 'BEGIN { exit !(t <= limit + 5) }' || fail "$what: too slow" "$out"
  [[ $(grep -c "mpipe: error" <<<"$out") -eq 1 ]] || fail "$what: not exactly one error line" "$out"
  grep -Eq "mpipe: error: (rank|ranks) $victim[ ,].*stopped answering" <<<"$out" || fail "$what: the line names another rank" "$out"
  echo "$what: $(grep "mpipe: error" <<<"$out" | cut -c1-160)"
done
