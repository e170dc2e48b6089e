#!/usr/bin/env bash
# Pipeline speed-up on this machine: throughput of K = 2 stages over K = 1 (one BLAS
# thread per rank) for M = 1, 2, 4, 8, 16 micro-batches of a fixed size, on a GPT whose
# two stages balance, beside the bound 2M/(M+1); measured and theoretical bubble; and
# peak activation memory per rank with --remat always against never.
#   STEPS=N (default 6, the first excluded)   MS="1 2 4 8 16"   MICRO=samples per micro-batch
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
[[ -f build/release/CMakeCache.txt ]] || cmake --preset release >/dev/null
cmake --build --preset release --target mpipe >/dev/null
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
steps=${STEPS:-6}
micro=${MICRO:-4}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
model=(--model gpt --layers 4 --d-model 192 --heads 6 --seq-len 128 --vocab 64 --partition flops
       --threads 1 --steps "$steps" --log-every 1000000 --lr 1e-3)

# run K M REMAT -> "median_step_s mean_bubble peak_bytes_max" from the metrics and log
run() {
  local K=$1 M=$2 remat=$3
  mpirun -n "$K" --bind-to core build/release/mpipe train "${model[@]}" --micro-batches "$M" \
    --batch-size $((M * micro)) --remat "$remat" --metrics "$tmp/m.jsonl" > "$tmp/log"
  /usr/bin/python3 - "$tmp/m.jsonl" "$tmp/log" <<'PY'
import json, re, statistics, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "step" in r][1:]  # per-step lines, not the summary
log = open(sys.argv[2]).read()
peaks = re.search(r"peak activation memory per rank:(.*)", log).group(1).split()
units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
peak = max(float(v) * units[u] for v, u in zip(peaks[::2], peaks[1::2]))
print(statistics.median(r["step_time_s"] for r in rows), statistics.mean(r["bubble_fraction"] for r in rows), peak)
PY
}

echo "GPT 4 blocks x 192 channels, seq 128, vocab 64, micro-batch $micro samples; 1 thread per rank;"
echo "step times: median of $((steps - 1)) steps, averaged over two alternating runs of each K"
printf '%4s %12s %12s %9s %9s %7s %11s %11s %12s %12s\n' M "K=1 samp/s" "K=2 samp/s" speedup "bound" "of bound" \
  "bubble" "theory" "peak never" "peak always"
for M in ${MS:-1 2 4 8 16}; do
  # K=1 and K=2 alternate, twice each, so that drifts of this machine hit both alike.
  read -r t1a _ _ < <(run 1 "$M" never)
  read -r t2a b2a p_never < <(run 2 "$M" never)
  read -r t1b _ _ < <(run 1 "$M" never)
  read -r t2b b2b _ < <(run 2 "$M" never)
  read -r _ _ p_always < <(run 2 "$M" always)
  t1=$(/usr/bin/python3 -c "print(($t1a + $t1b) / 2)")
  t2=$(/usr/bin/python3 -c "print(($t2a + $t2b) / 2)")
  b2=$(/usr/bin/python3 -c "print(($b2a + $b2b) / 2)")
  /usr/bin/python3 - "$M" "$micro" "$t1" "$t2" "$b2" "$p_never" "$p_always" <<'PY'
import sys
M, micro = int(sys.argv[1]), int(sys.argv[2])
t1, t2, bubble, never, always = map(float, sys.argv[3:])
s1, s2 = M * micro / t1, M * micro / t2
bound = 2 * M / (M + 1)
mib = lambda b: f"{b / 2**20:.1f} MiB"
print(f"{M:4d} {s1:12.2f} {s2:12.2f} {s2 / s1:8.3f}x {bound:8.3f}x {100 * s2 / s1 / bound:6.1f}% "
      f"{100 * bubble:10.1f}% {100 / (M + 1):10.1f}% {mib(never):>12} {mib(always):>12}")
PY
done

# What this machine allows: two independent single-stage jobs at once, one per core,
# against one alone. The pipeline's speed-up cannot beat bound x this efficiency.
M=8
model_solo=(build/release/mpipe train "${model[@]}" --micro-batches "$M" --batch-size $((M * micro)))
taskset -c 0 "${model_solo[@]}" --metrics "$tmp/solo1.jsonl" > /dev/null
taskset -c 0 "${model_solo[@]}" --metrics "$tmp/a.jsonl" > /dev/null &
taskset -c 1 "${model_solo[@]}" --metrics "$tmp/b.jsonl" > /dev/null
wait
taskset -c 1 "${model_solo[@]}" --metrics "$tmp/solo2.jsonl" > /dev/null
/usr/bin/python3 - "$tmp" <<'PY'
import json, statistics, sys
med = lambda f: statistics.median(r["step_time_s"] for r in list(map(json.loads, open(f"{sys.argv[1]}/{f}.jsonl")))[1:]
                                  if "step" in r)
solo, a, b = (med("solo1") + med("solo2")) / 2, med("a"), med("b")  # alone: before and after
print(f"machine: two independent K=1 jobs (M=8) run at {100 * solo / a:.1f}% and {100 * solo / b:.1f}% of one alone "
      f"(parallel efficiency {100 * 2 * solo / (a + b):.1f}%): the ceiling for K=2 is bound x that")
PY
