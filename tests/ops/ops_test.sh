#!/usr/bin/env bash
# Operations output with the real binary: trace, summary, sweep CSV and the plots.
# Usage: ops_test.sh MPIPE CASE   (CASE: trace | sweep)
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
assert names == {r: f"rank {r}: stage {r}, replica 0" for r in range(4)}, names
boxes = [e for e in t if e.get("ph") == "X"]
for rank in range(4):
    for step in (1, 2):  # traced steps, after the first
        for kind in ("forward", "backward"):
            mbs = sorted(e["args"]["micro_batch"] for e in boxes
                         if e["tid"] == rank and e["args"]["step"] == step and e["cat"] == kind)
            assert mbs == list(range(8)), (rank, step, kind, mbs)
assert not any(e["args"]["step"] in (0, 3) for e in boxes), "untraced steps in the trace"
# GPipe order on every rank: all forwards of a step before its first backward.
for rank in range(4):
    f = [e for e in boxes if e["tid"] == rank and e["args"]["step"] == 1 and e["cat"] == "forward"]
    b = [e for e in boxes if e["tid"] == rank and e["args"]["step"] == 1 and e["cat"] == "backward"]
    assert max(e["ts"] + e["dur"] for e in f) <= min(e["ts"] for e in b) + 1e-3
s = json.load(open(sys.argv[2]))
for key in ("samples_per_s", "step_time_s", "bubble_fraction", "theoretical_bubble", "peak_activation_bytes_per_stage"):
    assert key in s, key
assert s["stages"] == 4 and len(s["peak_activation_bytes_per_stage"]) == 4 and s["samples_per_s"] > 0
assert abs(s["theoretical_bubble"] - 3 / 11) < 1e-9
last = json.loads(open(sys.argv[3]).read().splitlines()[-1])
assert last == s, "the metrics file's last line is not the summary"
PY
  /usr/bin/python3 "$root/scripts/plot_timeline.py" "$work/t.json" "$work/t.png" --step 1 > /dev/null
  [[ $(stat -c %s "$work/t.png") -gt 10000 ]] || fail "timeline PNG missing or empty"
  ;;
sweep)
  bash "$root/scripts/sweep_microbatches.sh" --ms "1 4" --schedules "gpipe 1f1b" --ranks 2 --micro-size 2 \
    --out "$work/sweep.csv" -- "${small[@]}" --steps 3 > "$work/log"
  [[ $(wc -l < "$work/sweep.csv") -eq 5 ]] || fail "expected a header and 4 rows: $(cat "$work/sweep.csv")"
  head -1 "$work/sweep.csv" | grep -q "^M,schedule,K,D,samples_per_s,step_time_s,bubble,theoretical_bubble" \
    || fail "CSV header: $(head -1 "$work/sweep.csv")"
  grep -q "^4,1f1b,2,1," "$work/sweep.csv" || fail "no M=4 1f1b row: $(cat "$work/sweep.csv")"
  /usr/bin/python3 "$root/scripts/plot_sweep.py" "$work/sweep.csv" "$work/sweep.png" > /dev/null
  [[ $(stat -c %s "$work/sweep.png") -gt 10000 ]] || fail "sweep PNG missing or empty"
  ;;
*) fail "unknown case $case" ;;
esac
echo "ok: $case"
