#!/usr/bin/env bash
# A rank paused (SIGSTOP, then SIGCONT 1.5 s later: a suspended job, a debugger, a loaded
# machine's worst stall) for less than --p2p-timeout is no failure: every run must end with
# exit 0 and no error line, whichever rank is paused and wherever the pause falls (start-up,
# steps, checkpoints, the end). The paused rank used to judge itself stopped by its
# watchdog thread's late wake, go quiet and abort 8 s later: a job that had done all its
# work exited 1 with no line (issue 48 H).
# Usage: paused_rank.sh MPIPE
set -u
mpipe=$1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { printf 'FAIL: %s\n%s\n' "$1" "${2:-}"; exit 1; }
args=(train --model gpt --layers 3 --d-model 32 --heads 4 --seq-len 16 --vocab 64 --batch-size 8 --micro-batches 4
      --threads 1 --log-every 1000 --steps 150 --checkpoint-every 5 --p2p-timeout 10)
# pid_of RANK: the process of that world rank of this job (Open MPI puts it in the environment)
pid_of() {
  for p in $(pgrep -f "$mpipe train"); do
    tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$1" && echo "$p" && return
  done
}
paused=0
for rank in 1 0; do
  for delay in 0.2 0.7 1.2; do
    rm -rf "$work/d"
    mpiexec -n 2 --oversubscribe "$mpipe" "${args[@]}" --checkpoint-dir "$work/d" > "$work/log" 2>&1 & job=$!
    sleep "$delay"
    pid=$(pid_of "$rank")
    if [[ -n $pid ]] && kill -STOP "$pid" 2>/dev/null; then
      sleep 1.5
      kill -CONT "$pid"
      paused=$((paused + 1))
    fi
    ( sleep 90; kill -9 "$job" 2>/dev/null ) & guard=$!
    wait "$job"; rc=$?
    kill "$guard" 2>/dev/null
    what="rank $rank paused 1.5 s after ${delay} s"
    [[ $rc -eq 0 ]] || fail "$what: exit $rc" "$(grep -v '^ ' "$work/log" | tail -15)"
    ! grep -q "error\|MPI_ABORT" "$work/log" || fail "$what: an error line" "$(grep -v '^ ' "$work/log" | tail -15)"
    grep -q "^step  *150/150" "$work/log" || fail "$what: no last step" "$(tail -5 "$work/log")"
    echo "$what${pid:+ (pid $pid)}: exit 0"
  done
done
((paused >= 4)) || fail "only $paused of 6 runs were paused (the runs ended first): make them longer"
