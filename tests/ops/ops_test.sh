#!/usr/bin/env bash
# Operations output with the real binary: trace, summary, sweep CSV and the plots.
# Usage: ops_test.sh MPIPE CASE   (CASE: trace | overlap | remat | sweep | progress)
set -euo pipefail
mpipe=$1 case=$2
root=$(cd "$(dirname "$0")/../.." && pwd)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
small=(--model gpt --layers 2 --d-model 32 --heads 4 --seq-len 16 --vocab 64 --threads 1)

case $case in
trace)
  mpiexec -n 4 --oversubscribe "$mpipe" train "${small[@]}" --batch-size 16 --micro-batches 8 --steps 4 \
    --trace "$work/t.json" --trace-steps 2 --summary "$work/s.json" --metrics "$work/m.jsonl" > "$work/log"
  /usr/bin/python3 - "$work/t.json" "$work/s.json" "$work/m.jsonl" <<'PY' || fail "trace or summary content"
import json, sys
t = json.load(open(sys.argv[1]))["traceEvents"]
names = {e["tid"]: e["args"]["name"] for e in t if e.get("ph") == "M" and e["name"] == "thread_name"}
assert {t: n for t, n in names.items() if t < 4} == {r: f"rank {r}: stage {r}, replica 0" for r in range(4)}, names
assert all(n.startswith(f"rank {t % 4}: stage {t % 4}, replica 0: communication") for t, n in names.items() if t >= 4)
boxes = [e for e in t if e.get("ph") == "X"]
for rank in range(4):
    for step in (2, 3):  # traced steps, after the first (numbered as the console does, from 1)
        for kind in ("forward", "backward"):
            mbs = sorted(e["args"]["micro_batch"] for e in boxes
                         if e["tid"] == rank and e["args"]["step"] == step and e["cat"] == kind)
            assert mbs == list(range(8)), (rank, step, kind, mbs)
assert not any(e["args"]["step"] in (1, 4) for e in boxes), "untraced steps in the trace"
# GPipe order on every rank: all forwards of a step before its first backward.
for rank in range(4):
    f = [e for e in boxes if e["tid"] == rank and e["args"]["step"] == 2 and e["cat"] == "forward"]
    b = [e for e in boxes if e["tid"] == rank and e["args"]["step"] == 2 and e["cat"] == "backward"]
    assert max(e["ts"] + e["dur"] for e in f) <= min(e["ts"] for e in b) + 1e-3
s = json.load(open(sys.argv[2]))
for key in ("samples_per_s", "step_time_s", "bubble_fraction", "theoretical_bubble", "peak_activation_bytes_per_stage"):
    assert key in s, key
assert s["stages"] == 4 and len(s["peak_activation_bytes_per_stage"]) == 4 and s["samples_per_s"] > 0
# The console's per-stage phase table, in seconds: [min, mean, max] per phase and stage.
phases = ("forward", "backward", "recompute", "p2p_wait", "allreduce", "optimizer", "idle", "step")
assert [p["stage"] for p in s["phase_s"]] == [0, 1, 2, 3], s["phase_s"]
for p in s["phase_s"]:
    assert all(0 <= p[k][0] <= p[k][1] <= p[k][2] for k in phases), p
    assert p["forward"][1] > 0 and p["backward"][1] > 0 and p["step"][1] >= p["forward"][1] + p["backward"][1], p
# Every send appears on its rank's communication track, from its posting to its completion.
for rank in range(4):
    for step in (2, 3):
        sends = [e for e in boxes if e["args"]["rank"] == rank and e["args"]["step"] == step and e["cat"].startswith("send ")]
        assert all(names[e["tid"]].startswith(f"rank {rank}: stage {rank}, replica 0: communication") for e in sends)
        assert len(sends) == (8 if rank in (0, 3) else 16), (rank, step, len(sends))
assert abs(s["theoretical_bubble"] - 3 / 11) < 1e-9
# GPipe simulated with the run's own action times: a bubble, and one of the same order as the
# unit-cost one (K = 4, M = 8: every stage but one waits for the others at both ends).
assert 0.5 * 3 / 11 < s["simulated_bubble"] < 0.9, s["simulated_bubble"]
last = json.loads(open(sys.argv[3]).read().splitlines()[-1])
assert last == s, "the metrics file's last line is not the summary"
# One step numbering: the metrics' steps are the console's, 1 to --steps.
steps = [json.loads(l)["step"] for l in open(sys.argv[3]).read().splitlines()[:-1]]
assert steps == [1, 2, 3, 4], steps
PY
  grep -q "step      4/4" "$work/log" || fail "no console line for step 4"
  grep -q "trace of steps 2-3 written" "$work/log" || fail "the console names other traced steps"
  /usr/bin/python3 "$root/scripts/plot_timeline.py" "$work/t.json" "$work/t.png" --step 2 > /dev/null
  [[ $(stat -c %s "$work/t.png") -gt 10000 ]] || fail "timeline PNG missing or empty"
  ;;
overlap)
  # The pipeline overlaps where MPI needs the sender's help to move a message: Open MPI's
  # shared memory without single-copy, large messages (here 64 KiB, above the eager
  # limit). Stage 1 starts micro-batch 0 before stage 0 ends its last forward, and
  # stage 0 starts its first backward before stage 1 ends its last. Without progress
  # (--comm-progress waits) they do not, which the control run shows. With two
  # replicas, gradient sums over replicas finish while the last backward still runs
  # (and, in the control run, only after it). One fragment a turn of the sender's progress
  # (pml_ob1_send_pipeline_depth 1; mpipe's own default moves a message in one turn, and
  # the sender's next post of a send then finds the receiver's answer and finishes it):
  # what is checked is the progress, not the depth.
  # Four steps are traced (2-5). The runs with progress must overlap in some traced step,
  # the control runs in none. A loaded machine can still starve the overlap: a rank's
  # partner descheduled for a time slice (milliseconds) answers a rendezvous after the
  # short last backward has ended. So a run with progress that overlapped in no traced
  # step runs again, up to three times; a missing progress never overlaps, whatever the
  # tries, and a control run is never retried.
  run() {
    mpiexec -n 2 --mca btl_vader_single_copy_mechanism none --mca pml_ob1_send_pipeline_depth 1 "$mpipe" train --model gpt --layers 4 --d-model 128 \
      --heads 4 --seq-len 64 --vocab 64 --threads 1 --batch-size 16 --micro-batches 8 --steps 6 --resume never \
      --trace "$work/$1.json" --trace-steps 4 "${@:2}" > "$work/$1.log"
  }
  check() {  # check RUN: overlap.py's verdict on that run (3: a run with progress did not overlap)
    /usr/bin/python3 "$work/overlap.py" "$work" "$1"
  }
  cat > "$work/overlap.py" <<'PY'
import json, sys
work, what = sys.argv[1], sys.argv[2]
steps = (2, 3, 4, 5)
def boxes(run):
    return [e for e in json.load(open(f"{work}/{run}.json"))["traceEvents"] if e.get("ph") == "X"]
def pipeline_overlaps(run):  # per traced step: (forward, backward) overlapped between the stages
    verdicts = []
    all_boxes = boxes(run)
    for step in steps:
        mine = [e for e in all_boxes if e["args"]["step"] == step]
        def box(rank, kind, mb):
            (e,) = [e for e in mine if e["tid"] == rank and e["cat"] == kind and e["args"]["micro_batch"] == mb]
            return e["ts"], e["ts"] + e["dur"]
        verdicts.append((box(1, "forward", 0)[0] < box(0, "forward", 7)[1],
                         box(0, "backward", 0)[0] < box(1, "backward", 7)[1]))
    return verdicts
def sums_before_backward_ends(run):  # per traced step and rank: gradient sums done before its last backward ends
    verdicts = []
    all_boxes = boxes(run)
    for step in steps:
        counts = []
        for rank in (0, 1):
            mine = [e for e in all_boxes if e["args"]["step"] == step and e["args"]["rank"] == rank]
            end = max(e["ts"] + e["dur"] for e in mine if e["cat"] == "backward")
            sums = [e for e in mine if e["cat"] == "gradient sum"]
            assert len(sums) == 7, len(sums)  # one per layer with parameters
            counts.append(sum(e["ts"] + e["dur"] < end for e in sums))
        verdicts.append(counts)
    return verdicts
if what == "thread":
    v = pipeline_overlaps("thread")
    print("overlap (forward, backward) per traced step with a progress thread:", v)
    # Both ways within one step: the stages ran side by side while messages moved.
    sys.exit(0 if (True, True) in v else 3)
if what == "waits":
    v = pipeline_overlaps("waits")
    print("overlap (forward, backward) per traced step, waits only:", v)
    # Without progress a message can still slip through when an MPI call the sender makes
    # anyway (posting its next send) happens to find the receiver's acknowledgement; under
    # load that happens in one direction now and then, never in both.
    assert (True, True) not in v, "the control run overlapped both ways: the check would not catch a missing progress"
if what == "replicas":
    v = sums_before_backward_ends("replicas")
    print("gradient sums done before the last backward ends, per traced step and rank, with a progress thread:", v)
    # The replica that ends its backward later finds its partner's parts there already: its
    # sums finish while it computes (the earlier one may have to wait for the later one).
    sys.exit(0 if max(max(c) for c in v) >= 1 else 3)
if what == "replicas-waits":
    v = sums_before_backward_ends("replicas-waits")
    print("gradient sums done before the last backward ends, per traced step and rank, waits only:", v)
    assert max(max(c) for c in v) == 0, "the control run overlapped its gradient sums"
PY
  run waits --comm-progress waits
  check waits || fail "overlap: the control run"
  run replicas-waits --replicas 2 --micro-batches 4 --comm-progress waits
  check replicas-waits || fail "overlap: the control run with replicas"
  for what in thread replicas; do
    args=(); [[ $what == replicas ]] && args=(--replicas 2 --micro-batches 4)
    for try in 1 2 3; do
      run $what "${args[@]}"
      set +e; check $what; rc=$?; set -e
      [[ $rc == 0 ]] && break
      [[ $rc == 3 ]] || fail "overlap: the $what run's trace could not be read"
      [[ $try == 3 ]] && fail "overlap: no traced step overlapped with a progress thread ($what), three runs"
      echo "no overlap in any traced step ($what, run $try of 3): the machine may be loaded; again"
    done
  done
  ;;
progress)
  # Batch logs stay clean: mpirun hands every rank a pseudo-terminal, yet output that goes
  # to a file (or a pipe) holds no carriage return and no escape sequence; on a terminal
  # (script(1) gives one) the live line is there, and --progress on/off override both.
  run=(train "${small[@]}" --batch-size 8 --micro-batches 2 --steps 30 --log-every 10 --resume never)
  esc=$'\033'
  clean() { ! grep -q $'\r' "$1" && ! grep -q "$esc" "$1"; }
  mpiexec -n 2 "$mpipe" "${run[@]}" > "$work/file.log" 2>&1
  clean "$work/file.log" || fail "a redirected mpirun log holds the live line: $(cat -A "$work/file.log" | head -5)"
  grep -q "step     30/30" "$work/file.log" || fail "no log line for the last step"
  mpiexec -n 2 "$mpipe" "${run[@]}" 2>&1 | cat > "$work/pipe.log"
  clean "$work/pipe.log" || fail "a piped mpirun log holds the live line"
  script -qec "mpiexec -n 2 $mpipe ${run[*]}" /dev/null > "$work/tty.log" 2>&1
  grep -q "ETA" "$work/tty.log" && grep -q "$esc\[K" "$work/tty.log" || fail "no live line on a terminal"
  script -qec "mpiexec -n 2 $mpipe ${run[*]} --progress off" /dev/null > "$work/off.log" 2>&1
  ! grep -q "ETA" "$work/off.log" || fail "--progress off still shows the live line"
  grep -q "step     30/30" "$work/off.log" || fail "--progress off lost the log lines"
  mpiexec -n 2 "$mpipe" "${run[@]}" --progress on > "$work/on.log" 2>&1
  grep -q "ETA" "$work/on.log" || fail "--progress on shows no live line"
  set +e; out=$("$mpipe" "${run[@]}" --progress maybe 2>&1); rc=$?; set -e
  [[ $rc -eq 2 ]] && grep -q "unknown --progress 'maybe'" <<<"$out" || fail "bad --progress: rc $rc: $out"
  ;;
remat)
  # --remat always recomputes a micro-batch's forward before its backward on every stage
  # but the model's last, whose forwards run once, just before their backwards (nothing
  # goes on from there): under GPipe and 1F1B each of the first stage's, none of the
  # last's. The losses are the same bits either way.
  for schedule in gpipe 1f1b; do
    mpiexec -n 2 "$mpipe" train "${small[@]}" --batch-size 8 --micro-batches 4 --steps 3 --resume never \
      --schedule $schedule --remat always --trace "$work/$schedule.json" --trace-steps 1 > "$work/$schedule.log"
    mpiexec -n 2 "$mpipe" train "${small[@]}" --batch-size 8 --micro-batches 4 --steps 3 --resume never \
      --schedule $schedule --remat never > "$work/$schedule-never.log"
    diff <(grep -o 'loss [0-9.]*' "$work/$schedule.log") <(grep -o 'loss [0-9.]*' "$work/$schedule-never.log") \
      || fail "$schedule: --remat always and never differ in loss"
    grep -q 'loss [0-9]' "$work/$schedule.log" || fail "$schedule: no loss in the log"
  done
  /usr/bin/python3 - "$work" <<'PY' || fail "recomputed micro-batches"
import json, sys
def recomputed(schedule, rank):
    t = json.load(open(f"{sys.argv[1]}/{schedule}.json"))["traceEvents"]
    boxes = [e for e in t if e.get("ph") == "X" and e["tid"] == rank and e["args"]["step"] == 2]
    assert sorted(e["args"]["micro_batch"] for e in boxes if e["cat"] == "backward") == [0, 1, 2, 3]
    return sorted(e["args"]["micro_batch"] for e in boxes if e["cat"] == "recompute")
got = {(s, r): recomputed(s, r) for s in ("gpipe", "1f1b") for r in (0, 1)}
assert got == {("gpipe", 0): [0, 1, 2, 3], ("gpipe", 1): [], ("1f1b", 0): [0, 1, 2, 3], ("1f1b", 1): []}, got
# The last stage's forwards ran anyway, each just before its backward: F0 B0 F1 B1 ...
for schedule in ("gpipe", "1f1b"):
    t = json.load(open(f"{sys.argv[1]}/{schedule}.json"))["traceEvents"]
    boxes = sorted((e["ts"], e["cat"], e["args"]["micro_batch"]) for e in t
                   if e.get("ph") == "X" and e["tid"] == 1 and e["args"]["step"] == 2 and e["cat"] in ("forward", "backward"))
    order = [(c, mb) for _, c, mb in boxes]
    assert order == [(c, mb) for mb in range(4) for c in ("forward", "backward")], (schedule, order)
PY
  ;;
sweep)
  bash "$root/scripts/sweep_microbatches.sh" --ms "1 4" --schedules "gpipe 1f1b interleaved:2" --ranks 2 --micro-size 2 \
    --out "$work/sweep.csv" -- "${small[@]}" --steps 3 > "$work/log" 2> "$work/err"
  # interleaved:2 skips M = 1 (not a multiple of the 2 stages), saying so.
  [[ $(wc -l < "$work/sweep.csv") -eq 6 ]] || fail "expected a header and 5 rows: $(cat "$work/sweep.csv")"
  grep -q "^4,interleaved:2,2,1," "$work/sweep.csv" || fail "no M=4 interleaved row: $(cat "$work/sweep.csv")"
  grep -q "M=1: interleaved:2 needs a multiple of the 2 stages; skipped" "$work/err" || fail "no skip line: $(cat "$work/err")"
  head -1 "$work/sweep.csv" | grep -q "^M,schedule,K,D,samples_per_s,step_time_s,bubble,theoretical_bubble" \
    || fail "CSV header: $(head -1 "$work/sweep.csv")"
  grep -q "^4,1f1b,2,1," "$work/sweep.csv" || fail "no M=4 1f1b row: $(cat "$work/sweep.csv")"
  /usr/bin/python3 "$root/scripts/plot_sweep.py" "$work/sweep.csv" "$work/sweep.png" > /dev/null
  [[ $(stat -c %s "$work/sweep.png") -gt 10000 ]] || fail "sweep PNG missing or empty"
  ;;
*) fail "unknown case $case" ;;
esac
echo "ok: $case"
