#!/usr/bin/env bash
# The fault matrix: bad inputs, signals and kills at random points (checkpoint writes
# included), stopped ranks, a full disk, two jobs on one directory. Each case runs the
# real binary under mpiexec and prints one row: exit code, seconds to exit, complete
# checkpoints before and after, verdict. Exits 1 if any verdict is not ok.
#   scripts/faults.sh [MPIPE]        (default build/release/mpipe; ctest label: faults)
#   FAULT_ROUNDS=N                   random kill/stop rounds per case (default 3)
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mpipe=$(realpath "${1:-$root/build/release/mpipe}")
[[ -x "$mpipe" ]] || { echo "no mpipe binary at $mpipe (build first: cmake --build --preset release)"; exit 2; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
rounds=${FAULT_ROUNDS:-3}
work=$(mktemp -d)
trap 'umount "$work/full" 2>/dev/null; rm -rf "$work"' EXIT
timeout_s=3   # --p2p-timeout of the kill and stop cases: each must end within it + 4 s
# (a stop is named once the heartbeats prove it, ~1 s of teardown after the timeout: 4.0-4.1 s
# measured; a roll call that sat out its whole 3 s grace took 6-8 s)
model=(--model gpt --layers 3 --d-model 32 --heads 4 --seq-len 16 --vocab 64 --batch-size 8 --micro-batches 4
       --threads 1 --log-every 1000 --p2p-timeout "$timeout_s")
launch() { mpiexec -n "$1" --oversubscribe "$mpipe" train "${model[@]}" "${@:2}"; }
# In the background (launch_bg N ARGS... &): the job's $! is mpiexec itself.
launch_bg() { exec mpiexec -n "$1" --oversubscribe "$mpipe" train "${model[@]}" "${@:2}"; }

bad=0
printf '%-40s %5s %7s %7s %7s  %s\n' case exit seconds ckpt-in ckpt-out verdict
# complete DIR: the checkpoints in DIR that verify, newest last (one per line)
complete() { for f in "$1"/ckpt-*.h5; do [[ -f "$f" ]] && "$mpipe" inspect "$f" --verify >/dev/null 2>&1 && basename "$f"; done; }
count() { complete "$1" | grep -c . ; }
# row NAME RC SECONDS BEFORE AFTER PROBLEM: the verdict is ok when PROBLEM is empty
row() {
  local verdict=ok
  [[ -n "$6" ]] && verdict="BAD: $6" && bad=$((bad + 1))
  printf '%-40s %5s %7s %7s %7s  %s\n' "$1" "$2" "$3" "$4" "$5" "$verdict"
}
now() { date +%s.%N; }
since() { /usr/bin/python3 -c "import sys,time; print(f'{time.time() - float(sys.argv[1]):.1f}')" "$1"; }
over() { /usr/bin/python3 -c "import sys; sys.exit(not float(sys.argv[1]) > float(sys.argv[2]))" "$1" "$2"; }
# one_error LOG: exactly one "mpipe: error" line, and no stack trace
one_error() {
  [[ $(grep -c "mpipe: error" "$1") -eq 1 ]] || { echo "not one error line"; return; }
  ! grep -q "Signal: Segmentation\|terminate called\|Backtrace\|\*\*\* Process received" "$1" || echo "a crash"
}

# wait_guarded PID: waits for the job (killed after 30 s: a hang), its exit code in rc
wait_guarded() {
  ( sleep 30; kill -9 "$1" 2>/dev/null; pkill -9 -P "$1" 2>/dev/null ) & local guard=$!
  wait "$1"; rc=$?
  kill "$guard" 2>/dev/null; wait "$guard" 2>/dev/null
}
# stop_problem LOG RC TOOK LIMIT REGEX: what is wrong with a job a stopped rank must end
# (non-zero, within LIMIT seconds, one error line, matching REGEX), or nothing
stop_problem() {
  local problem; problem=$(one_error "$1")
  [[ $2 -ne 0 && $2 -ne 137 ]] || problem="${problem:+$problem; }exit $2"
  over "$3" "$4" && problem="${problem:+$problem; }ended after $3 s"
  grep -Eq "$5" "$1" || problem="${problem:+$problem; }not named: $(grep -m1 "mpipe: error" "$1" | cut -c1-80)"
  echo "$problem"
}

# ---- bad inputs: exit 2, one error line, nothing written ------------------------------
# expect_two NAME DIR ARGS...: a run that must be refused, leaving DIR's checkpoints as they were
expect_two() {
  local name=$1 dir=$2; shift 2
  local before after start rc problem=""
  before=$(complete "$dir" 2>/dev/null | md5sum)
  local n_before; n_before=$(count "$dir" 2>/dev/null)
  start=$(now)
  "$@" > "$work/log" 2>&1 &  # launch_bg or a plain command: $! is the process itself
  local pid=$!
  ( sleep 60; kill -9 "$pid" 2>/dev/null ) & local guard=$!
  wait "$pid"; rc=$?
  kill "$guard" 2>/dev/null; wait "$guard" 2>/dev/null
  local took; took=$(since "$start")
  ((rc == 137)) && rc="hang"
  after=$(complete "$dir" 2>/dev/null | md5sum)
  [[ $rc -eq 2 ]] || problem="exit $rc, expected 2"
  [[ -z "$problem" ]] && problem=$(one_error "$work/log")
  [[ -z "$problem" && "$before" != "$after" ]] && problem="checkpoints changed"
  row "$name" "$rc" "$took" "$n_before" "$(count "$dir" 2>/dev/null)" "$problem"
}
mkdir -p "$work/empty" "$work/a" "$work/other" "$work/ahead"
printf 'heads = [2\n' > "$work/broken.toml"
mkfifo "$work/fifo"
expect_two "config: broken TOML" "$work/empty" launch_bg 2 --config "$work/broken.toml"
expect_two "config: duplicate key" "$work/empty" launch_bg 2 --config <(printf 'steps = 2\nsteps = 3\n')
expect_two "data: FIFO without a writer" "$work/empty" launch_bg 2 --data "text:$work/fifo" --vocab 256
expect_two "data: a directory" "$work/empty" launch_bg 2 --data "tokens:$work" --steps 2
expect_two "size: --layers 2000000000" "$work/empty" launch_bg 2 --layers 2000000000
expect_two "size: --batch-size 200000000" "$work/empty" launch_bg 1 --batch-size 200000000 --micro-batches 1
expect_two "plan: --layers 2000000000" "$work/empty" "$mpipe" plan --layers 2000000000
expect_two "nan --min-lr-ratio" "$work/empty" launch_bg 2 --min-lr-ratio nan
expect_two "output: --summary DIR" "$work/empty" launch_bg 2 --steps 2 --summary "$work"
expect_two "output: --metrics X --trace X" "$work/empty" launch_bg 2 --steps 2 --metrics "$work/x" --trace "$work/x"
expect_two "output: --metrics on a full disk" "$work/empty" launch_bg 2 --steps 4 --metrics /dev/full
# Checkpoint directories: another model's, an earlier run's, one beyond --steps.
launch 2 --steps 2 --checkpoint-dir "$work/a" --checkpoint-every 1 >/dev/null 2>&1
launch 2 --layers 2 --steps 2 --checkpoint-dir "$work/other" >/dev/null 2>&1
launch 2 --steps 6 --checkpoint-dir "$work/ahead" --checkpoint-every 2 >/dev/null 2>&1
expect_two "dir: another model's, --keep 1" "$work/other" launch_bg 2 --steps 4 --checkpoint-dir "$work/other" --keep 1
expect_two "dir: earlier run, --resume never" "$work/a" launch_bg 2 --steps 4 --checkpoint-dir "$work/a" --resume never --keep 1
expect_two "dir: checkpoint beyond --steps" "$work/ahead" launch_bg 2 --steps 3 --checkpoint-dir "$work/ahead" --keep 1
expect_two "dir: another optimizer's state" "$work/ahead" launch_bg 2 --steps 8 --checkpoint-dir "$work/ahead" --optimizer sgd
cp "$work/ahead/ckpt-00000006.h5" "$work/flipped.h5"
/usr/bin/python3 -c "import h5py,sys; h5py.File(sys.argv[1],'r+')['/train'].attrs.modify('step', 2)" "$work/flipped.h5"
expect_two "checkpoint: /train step flipped" "$work/ahead" launch_bg 2 --steps 8 --resume "$work/flipped.h5"
expect_two "checkpoint: not HDF5" "$work/ahead" launch_bg 2 --steps 8 --resume "$work/broken.toml"

# ---- two jobs on one directory ----------------------------------------------------------
mkdir "$work/shared"
launch_bg 2 --steps 100000 --checkpoint-dir "$work/shared" --checkpoint-every 20 --keep 2 > "$work/first.log" 2>&1 &
first=$!
for _ in $(seq 200); do compgen -G "$work/shared/ckpt-*.h5" >/dev/null && break; sleep 0.05; done
# (the first job goes on writing: the second's "nothing changed" is checked on an empty dir)
expect_two "dir: a second job while one runs" "$work/empty" launch_bg 2 --steps 100000 --checkpoint-dir "$work/shared" --overwrite
kill -USR1 "$first"; wait "$first"; rc=$?
n=$(count "$work/shared")
row "dir: the first job, then SIGUSR1" "$rc" "-" "-" "$n" \
  "$([[ $rc -eq 75 && $n -ge 1 && ! -e $work/shared/.mpipe.lock ]] || echo "exit $rc, $n checkpoints, lock $(ls -A "$work/shared" | grep -c lock)")"

# ---- signals and kills at random points, checkpoints every step -----------------------
# fault NAME SIGNAL TARGET ROUND: TARGET is mpirun or a rank; a kill -9 or SIGSTOP must end
# the job within --p2p-timeout + 4 s, a stop signal must leave a new checkpoint; no complete
# checkpoint may be lost.
fault() {
  local name=$1 signal=$2 target=$3 dir="$work/f-$1-$4"
  dir=${dir// /_}
  mkdir -p "$dir"
  launch_bg 3 --steps 100000 --checkpoint-dir "$dir" --checkpoint-every 1 --keep 3 --log-every 1 > "$work/log" 2>&1 &
  local pid=$!
  for _ in $(seq 200); do compgen -G "$dir/ckpt-*.h5" >/dev/null && break; sleep 0.05; done
  sleep "0.$((RANDOM % 10))"
  # The newest complete checkpoint at the fault (names only: a check would let time pass).
  local newest; newest=$(cd "$dir" && ls ckpt-*.h5 2>/dev/null | tail -1)
  local n_before; n_before=$(cd "$dir" && ls ckpt-*.h5 2>/dev/null | grep -c .)
  local victim=$pid rank=""
  if [[ $target == rank ]]; then
    victim=$(pgrep -P "$pid" -x mpipe | shuf -n 1)
    rank=$(tr '\0' '\n' < "/proc/$victim/environ" | sed -n 's/^OMPI_COMM_WORLD_RANK=//p')
  fi
  local start; start=$(now)
  kill "-$signal" "$victim"
  # A rank stopped with SIGSTOP is still ours to end after the test.
  ( sleep 30; kill -9 "$pid" 2>/dev/null; pkill -9 -P "$pid" 2>/dev/null ) & local guard=$!
  wait "$pid"; local rc=$?
  local took; took=$(since "$start")
  kill "$guard" 2>/dev/null; wait "$guard" 2>/dev/null
  local after; after=$(complete "$dir")
  local problem=""
  # Every ckpt-*.h5 left is complete, and the newest at the fault, or a newer one, is there.
  [[ $(grep -c . <<<"$after") -eq $(cd "$dir" && ls ckpt-*.h5 | grep -c .) ]] || problem="a damaged checkpoint in place"
  [[ -n "$(tail -1 <<<"$after")" && ! "$(tail -1 <<<"$after")" < "$newest" ]] || problem="${problem:+$problem; }lost $newest"
  case $signal in
    KILL|STOP)
      over "$took" $((timeout_s + 4)) && problem="${problem:+$problem; }ended after $took s"
      [[ $rc -ne 0 ]] || problem="${problem:+$problem; }exit 0"
      if [[ $signal == STOP ]]; then
        grep -Eq "mpipe: error: rank $rank (stopped answering|did not reach)" "$work/log" \
          || problem="${problem:+$problem; }rank $rank not named: $(grep -m1 "mpipe: error" "$work/log" | cut -c1-80)"
        [[ $(grep -c "mpipe: error" "$work/log") -le 1 ]] || problem="${problem:+$problem; }more than one error line"
      fi ;;
    TERM|USR1)
      [[ "$(tail -1 <<<"$after")" > "$newest" ]] || problem="${problem:+$problem; }no checkpoint after the signal"
      [[ ! -e "$dir/.mpipe.lock" ]] || problem="${problem:+$problem; }lock left behind"
      [[ $signal == TERM && $target == mpirun ]] || [[ $rc -eq 75 ]] || problem="${problem:+$problem; }exit $rc, expected 75" ;;
  esac
  row "$name${rank:+ (rank $rank)}" "$rc" "$took" "$n_before" "$(grep -c . <<<"$after")" "$problem"
  rm -rf "$dir"
}
for round in $(seq "$rounds"); do
  fault "kill -9 a rank" KILL rank "$round"
  fault "SIGSTOP a rank" STOP rank "$round"
  fault "SIGTERM to mpirun" TERM mpirun "$round"
  fault "SIGUSR1 to mpirun" USR1 mpirun "$round"
  fault "SIGTERM to a rank" TERM rank "$round"
done

# ---- a signal during start-up: exit 75 after the first step, not 138 -------------------
# To mpirun 1 s after launch, and to a rank 0.10-0.19 s after it appears: past its
# dynamic loader (~30 ms), inside what were cuBLASLt's ~0.35 s of loading, when a
# rank's first ~0.4 s gave 138.
startup() {  # startup NAME WHO
  local dir="$work/startup-$2" start pid victim rc
  mkdir "$dir"
  start=$(now)
  launch_bg 2 --steps 100000 --checkpoint-dir "$dir" > "$work/log" 2>&1 &
  pid=$!
  if [[ $2 == mpirun ]]; then
    sleep 1
    victim=$pid
  else
    for _ in $(seq 400); do victim=$(pgrep -P "$pid" -x mpipe | head -1) && break; sleep 0.005; done
    sleep "0.1$((RANDOM % 10))"
  fi
  kill -USR1 "$victim"; wait "$pid"; rc=$?
  row "$1" "$rc" "$(since "$start")" 0 "$(count "$dir")" "$([[ $rc -eq 75 ]] || echo "exit $rc, expected 75")"
}
startup "SIGUSR1 to mpirun in start-up" mpirun
for round in $(seq "$rounds"); do startup "SIGUSR1 to a new rank (round $round)" "rank$round"; done

# ---- a rank stopped in a phase of start-up (MPIPE_FAULT_STOP=PHASE@RANK: it stops itself
# as it enters PHASE), resuming from a checkpoint: ended within --p2p-timeout + 4 s, named
mkdir "$work/resume-from"
launch 2 --steps 2 --checkpoint-dir "$work/resume-from" >/dev/null 2>&1
phases=(MPI_Init hosts options directory lock device resolve executor connect allocate resume claim)
for round in $(seq "$rounds"); do
  phase=${phases[RANDOM % ${#phases[@]}]} victim=$((RANDOM % 2))
  start=$(now)
  MPIPE_FAULT_STOP="$phase@$victim" launch_bg 2 --steps 4 --checkpoint-dir "$work/resume-from" > "$work/log" 2>&1 &
  wait_guarded $!
  took=$(since "$start")
  problem=$(stop_problem "$work/log" "$rc" "$took" $((timeout_s + 4)) "mpipe: error: rank $victim stopped answering .*start-up \($phase\)")
  row "SIGSTOP rank $victim in start-up ($phase)" "$rc" "$took" 1 "$(count "$work/resume-from")" "$problem"
done

# ---- a rank stopped from outside during start-up (D=2 x K=2, 0.3-0.8 s after launch: in
# MPI_Init or just past it): named within --p2p-timeout + 5 s of the stop -----------------
rank_pid() {  # rank_pid JOB RANK: the pid of that world rank of the job, once it exists
  local p
  for p in $(pgrep -f "$mpipe train"); do
    tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$2" && echo "$p" && return
  done
}
for round in $(seq "$rounds"); do
  victim=$((1 + RANDOM % 3)) delay="0.$((3 + RANDOM % 6))"
  start=$(now)
  launch_bg 4 --steps 100000 --replicas 2 > "$work/log" 2>&1 &
  pid=$!
  victim_pid=""
  until [[ -n $victim_pid ]] || ! kill -0 "$pid" 2>/dev/null; do victim_pid=$(rank_pid "$pid" "$victim"); done
  left=$(/usr/bin/python3 -c "import sys,time; print(max(0.0, float(sys.argv[2]) - (time.time() - float(sys.argv[1]))))" "$start" "$delay")
  sleep "$left"; kill -STOP "$victim_pid"; stopped=$(now)
  wait_guarded "$pid"
  took=$(since "$stopped")
  problem=$(stop_problem "$work/log" "$rc" "$took" $((timeout_s + 5)) "mpipe: error: ranks? $victim[ ,].*stopped answering")
  row "SIGSTOP rank $victim ${delay} s after launch" "$rc" "$took" 0 0 "$problem"
done

# ---- a rank stopped during evaluation: named, with the rank that saw it ---------------------
start=$(now)
launch_bg 2 --steps 100000 --eval-data synthetic --eval-every 1 --eval-batches 50 > "$work/log" 2>&1 &
pid=$!
for _ in $(seq 300); do grep -q "^eval step" "$work/log" && break; sleep 0.05; done
victim_pid=$(rank_pid "$pid" 1)
sleep 0.3; kill -STOP "$victim_pid"; stopped=$(now)
wait_guarded "$pid"
took=$(since "$stopped")
problem=$(stop_problem "$work/log" "$rc" "$took" $((timeout_s + 5)) \
          "mpipe: error: rank 1 stopped answering .*Seen by rank 0 [^:]*(in evaluation|at step [0-9]+)")
row "SIGSTOP rank 1 in evaluation" "$rc" "$took" - - "$problem"

# ---- a rank paused for less than --p2p-timeout (SIGSTOP, SIGCONT 1.5 s later): no failure
for round in $(seq "$rounds"); do
  victim=$((RANDOM % 2)) dir="$work/paused"
  mkdir -p "$dir"
  start=$(now)
  launch_bg 2 --steps 300 --checkpoint-every 10 --checkpoint-dir "$dir" --p2p-timeout 10 > "$work/log" 2>&1 &
  pid=$!
  sleep "0.$((2 + RANDOM % 8))"
  victim_pid=$(rank_pid "$pid" "$victim")
  [[ -n $victim_pid ]] && kill -STOP "$victim_pid" && sleep 1.5 && kill -CONT "$victim_pid"
  wait "$pid"; rc=$?
  problem=""
  [[ $rc -eq 0 ]] || problem="exit $rc"
  grep -q "error\|MPI_ABORT" "$work/log" && problem="${problem:+$problem; }an error: $(grep -m1 "error\|MPI_ABORT" "$work/log" | cut -c1-80)"
  row "rank $victim paused 1.5 s (p2p-timeout 10)" "$rc" "$(since "$start")" 0 "$(count "$dir")" "$problem"
  rm -rf "$dir"
done

# ---- issue 48's inputs: a checkpoint one state of which is a soft link to the other, plan's
# largest model at 16 GiB and at 1e20 GiB, gpu_check's --out over a checkpoint, a data file
# truncated mid-run -------------------------------------------------------------------------
good=$(ls "$work/resume-from"/ckpt-*.h5 | tail -1)
cp "$good" "$work/alias.h5"
/usr/bin/python3 -c "
import h5py, sys
with h5py.File(sys.argv[1], 'r+') as f:
    n = '/optimizer/exp_avg/0000/wpe'; del f[n]; f[n] = h5py.SoftLink('/optimizer/exp_avg_sq/0000/wpe')" "$work/alias.h5"
expect_two "inspect --verify: a state aliasing another" "$work/empty" "$mpipe" inspect "$work/alias.h5" --verify
expect_two "resume: a state aliasing another" "$work/empty" launch_bg 2 --steps 4 --resume "$work/alias.h5"
start=$(now)
timeout 60 "$mpipe" plan --model gpt --layers 2 --d-model 32 --heads 2 --vocab 64 --seq-len 16 --batch-size 8 \
  --micro-batches 2 --ranks 2 --memory-per-rank 16GiB > "$work/log" 2>&1; rc=$?
took=$(since "$start")
row "plan --memory-per-rank 16GiB" "$rc" "$took" - - "$([[ $rc -eq 0 ]] || echo "exit $rc"; over "$took" 20 && echo "took $took s")"
expect_two "plan --memory-per-rank 1e20GiB" "$work/empty" "$mpipe" plan --memory-per-rank 1e20GiB
cp "$good" "$work/precious.h5"
bash "$root/scripts/gpu_check.sh" --out "$work/precious.h5" > "$work/log" 2>&1; rc=$?
problem=""
[[ $rc -eq 2 ]] || problem="exit $rc, expected 2"
grep -q "gpu_check.sh: --out '.*precious.h5' exists and is not a gpu_check report; hint" "$work/log" || problem="${problem:+$problem; }not said"
cmp -s "$good" "$work/precious.h5" || problem="${problem:+$problem; }the file was changed"
row "gpu_check.sh --out over a checkpoint" "$rc" - - - "$problem"
/usr/bin/python3 -c "
import h5py, numpy as np, sys
with h5py.File(sys.argv[1], 'w') as f:
    f['inputs'] = np.random.RandomState(0).rand(4000, 64).astype(np.float32)
    f['labels'] = np.random.RandomState(1).randint(0, 10, 4000).astype(np.int32)" "$work/data.h5"
start=$(now)
mpiexec -n 2 --oversubscribe "$mpipe" train --model mlp --layers 2 --data "hdf5:$work/data.h5" --batch-size 8 \
  --micro-batches 4 --threads 1 --steps 1000000 --log-every 1 > "$work/log" 2>&1 &
pid=$!
for _ in $(seq 300); do grep -q "^step  *3/" "$work/log" && break; sleep 0.1; done
truncate -s 5000 "$work/data.h5"
wait_guarded "$pid"
problem=$(one_error "$work/log")
[[ $rc -eq 2 ]] || problem="${problem:+$problem; }exit $rc, expected 2"
grep -q "mpipe: error: .*data.h5 changed while training read it" "$work/log" || problem="${problem:+$problem; }not said"
row "a data file truncated mid-run" "$rc" "$(since "$start")" - - "$problem"

# ---- a full disk under the checkpoint directory ----------------------------------------
mkdir "$work/full"
if mount -t tmpfs -o size=600k tmpfs "$work/full" 2>/dev/null; then
  start=$(now)
  launch 2 --steps 6 --checkpoint-dir "$work/full" --checkpoint-every 1 > "$work/log" 2>&1; rc=$?
  took=$(since "$start")
  problem=$(one_error "$work/log")
  [[ $rc -ne 0 ]] || problem="exit 0 on a full disk"
  grep -q "mpipe: error: checkpoint .*: .*(disk full?)\|No space left" "$work/log" || problem="${problem:+$problem; }not said: $(grep -m1 error "$work/log" | cut -c1-80)"
  compgen -G "$work/full/.*.tmp" >/dev/null && problem="${problem:+$problem; }a partial file left"
  row "full disk under --checkpoint-dir" "$rc" "$took" 0 "$(count "$work/full")" "$problem"
  umount "$work/full"
else
  printf '%-40s %5s %7s %7s %7s  %s\n' "full disk under --checkpoint-dir" - - - - "skipped (cannot mount a tmpfs here)"
fi

echo
if ((bad)); then echo "$bad case(s) handled badly"; exit 1; fi
echo "every case handled: 0 hangs, 0 crashes, 0 checkpoints lost"
