#!/usr/bin/env bash
# A U-Net (inputs/unet.toml) pipelined at K = 2 with its skips across the cut, one BLAS
# thread per rank: samples/s of K = 1 and of K = 2 (the partition by FLOPs and by measured
# time), rounds interleaved, the speed-up beside the GPipe bound 2M/(M+1), the measured
# bubble beside the one simulated from the run's own action times, and each rank's bytes
# sent to its neighbour stage and of skips beside what the skips' tensors hold (plan's
# skip lines: a message each way per micro-batch and step): a skip sent once, straight
# from its producer to its consumer, not through the stages between.
# The contention baseline (as scripts/scaling_check.sh's): two lone K = 1 runs at once, one a
# core, whose slower rate against a lone K = 1 run's is what this machine gives two busy
# cores (a pipeline goes at its slower core's pace; this VM's two cores differ by up to 25%,
# and which one is slower changes within minutes); the machine's own bound is
# 2 · slower_rate_together / rate_alone · M / (M + 1). Every ratio is taken within a round
# (its runs a minute apart), then the median over rounds.
# Rows: GPipe with the partition by FLOPs and by time, and 1F1B by time (a U-Net's encoder
# stages are backward-heavy and its decoder's forward-heavy: GPipe's forward and backward
# phases each wait on a different stage, 1F1B's alternation evens them out), zb-h1 by time
# (the W actions fill the lighter stage's waits: a bubble of 14-16% simulated against
# 1F1B's 19%, at the cost of a split backward), and 1F1B again with --comm-progress thread
# (the default, auto, runs no progress thread where shared memory copies by single-copy: on
# 2 cores the thread's wakes slowed the stages' actions, 1F1B 1.105x and GPipe 1.05x faster
# without it, 2026-11-29).
# KEEP=1 keeps the runs' logs and metrics (their directory is printed first).
# Environment: ROUNDS=3 rounds, STEPS=40 steps a run (the first excluded), M=8 micro-batches
# of BATCH=32 samples; MPIPE=PATH runs that binary and installs and builds nothing (the
# lent GPU machine, from scripts/gpu_check.sh). Each row also prints a line
# "RESULT name speed-up of-bound of-machine" for scripts.
set -euo pipefail
cd "$(dirname "$0")/.."
mpipe=${MPIPE:-}
if [[ -z $mpipe ]]; then
  bash scripts/setup.sh --test
  [[ -f build/release/CMakeCache.txt ]] || cmake --preset release >/dev/null
  cmake --build --preset release --target mpipe >/dev/null
  mpipe=build/release/mpipe
fi
[[ -x $mpipe ]] || { echo "bench_unet.sh: no $mpipe" >&2; exit 2; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
rounds=${ROUNDS:-3} steps=${STEPS:-40} M=${M:-8} batch=${BATCH:-32}
model=inputs/unet.toml
work=$(mktemp -d)
[[ -n ${KEEP:-} ]] && echo "runs kept in $work"
trap '[[ -n ${KEEP:-} ]] || rm -rf "$work"' EXIT
common=(train --model "$model" --batch-size "$batch" --micro-batches "$M" --steps "$steps" --threads 1 --log-every 1000)
run() {  # name ranks args...: one run's summary line into $work/name.R
  local name=$1 ranks=$2
  shift 2
  mpirun -n "$ranks" --oversubscribe --bind-to core "$mpipe" "${common[@]}" --metrics "$work/$name.$r.jsonl" "$@" \
    > "$work/$name.$r.log" 2>&1 || { echo "run $name failed:"; tail -5 "$work/$name.$r.log"; exit 1; }
}
together() {  # two K = 1 runs at once, each bound to a core of its own
  local i
  for i in 0 1; do
    taskset -c "$i" mpirun -n 1 --bind-to none "$mpipe" "${common[@]}" --metrics "$work/together$i.$r.jsonl" \
      > "$work/together$i.$r.log" 2>&1 &
  done
  wait
}
for ((r = 0; r < rounds; ++r)); do
  run k1 1
  run flops 2
  run time 2 --partition time
  run 1f1b 2 --partition time --schedule 1f1b
  run zb-h1 2 --partition time --schedule zb-h1  # weight gradients fill the heavier stage's waits
  run 1f1b-thread 2 --partition time --schedule 1f1b --comm-progress thread  # a progress thread beside each rank's compute
  together
  run k1b 1  # K = 1 again: a round's baseline is the mean of its first and last run
done
/usr/bin/python3 - "$work" "$rounds" "$M" <<'PY'
import json, re, statistics, sys
work, rounds, M = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def summary(name, r):
    with open(f"{work}/{name}.{r}.jsonl") as f:
        return json.loads(f.read().splitlines()[-1])
def log(name, r):
    return open(f"{work}/{name}.{r}.log").read()
bound = 2 * M / (M + 1)
k1 = [(summary("k1", r)["samples_per_s"] + summary("k1b", r)["samples_per_s"]) / 2 for r in range(rounds)]
base = statistics.median(k1)
pairs = [[summary(f"together{i}", r)["samples_per_s"] for i in (0, 1)] for r in range(rounds)]
slower = statistics.median(min(p) / k1[r] for r, p in enumerate(pairs))
faster = statistics.median(max(p) / k1[r] for r, p in enumerate(pairs))
machine_r = [2 * min(p) / k1[r] * M / (M + 1) for r, p in enumerate(pairs)]
machine = statistics.median(machine_r)
print(f"U-Net (inputs/unet.toml) at K = 2, M = {M}, {rounds} rounds interleaved; K = 1: {base:.1f} samples/s (median)")
print(f"contention: two K = 1 runs at once give {slower:.3f}x (the slower) and {faster:.3f}x (the faster) a lone one's rate; "
      f"the machine's bound {machine:.2f}x")
print(f"{'run':<10} {'cut':<14} {'samples/s':>10} {'speed-up':>9} {'bound':>6} {'of bound':>9} {'of machine':>11} {'bubble':>7} {'simulated':>10}  skips across")
results = []
for name in ("flops", "time", "1f1b", "zb-h1", "1f1b-thread"):
    rows = [summary(name, r) for r in range(rounds)]
    rate = statistics.median(s["samples_per_s"] for s in rows)
    speedup = statistics.median(s["samples_per_s"] / k1[r] for r, s in enumerate(rows))
    of_machine = statistics.median(s["samples_per_s"] / k1[r] / machine_r[r] for r, s in enumerate(rows))
    text = log(name, 0)
    cut = re.search(r"^partition \(\w+\): (.*)$", text, re.M).group(1)
    across = re.findall(r"^skip '(\w+)': layer \d+ -> \d+, stage \d -> \d", text, re.M)
    bubble = statistics.median(s["bubble_fraction"] for s in rows)
    simulated = statistics.median(s["simulated_bubble"] for s in rows)
    print(f"{name:<10} {cut:<14} {rate:10.1f} {speedup:8.2f}x {bound:5.2f}x {speedup / bound:8.2f}x {of_machine:10.2f}x {100 * bubble:6.1f}% {100 * simulated:9.1f}%  {', '.join(across) or 'none'}")
    results.append(f"RESULT {name} {speedup:.3f} {speedup / bound:.3f} {of_machine:.3f}")
# Traffic: each rank's skip bytes against the skips' tensors (plan: KiB a micro-batch each way).
text = log("time", 0)
s = summary("time", 0)
each = 0.0
for name, size, unit in re.findall(r"^skip '(\w+)': .*stage \d -> \d .*?, ([0-9.]+) (KiB|MiB) a micro-batch each way", text, re.M):
    each += float(size) * (1024 if unit == "KiB" else 1024 ** 2)
steps = s["steps_timed"] + 1
expected = each * M * steps  # forward from the producer, and the gradient back from the consumer: the same bytes each
print(f"skip bytes sent per rank (partition by time): {[int(b) for b in s['skip_bytes_per_rank']]}, "
      f"the skips' tensors {int(expected)} a rank ({'equal' if all(b == expected for b in s['skip_bytes_per_rank']) else 'NOT equal'}); "
      f"to the neighbour stage: {[int(b) for b in s['sent_bytes_per_rank']]}")
print("\n".join(results))
PY
