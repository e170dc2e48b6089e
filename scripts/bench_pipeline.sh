#!/usr/bin/env bash
# Pipeline speed-up on this machine, one BLAS thread per rank. Prints these tables:
#  1. A K ladder (1, 2, 4, 8 stages where cores allow) of a GPT whose stages balance:
#     tokens/s, speed-up over K = 1 beside the GPipe bound K*M/(M+K-1), measured and
#     theoretical bubble; for Open MPI's shared memory as it comes (single-copy, CMA)
#     and without single-copy (as in containers without ptrace rights, and like
#     rendezvous transports between nodes: every message needs both ranks' progress),
#     each with the progress thread and with MPI's own progress (--comm-progress waits,
#     the baseline), and with single-copy also the default, auto (tests between layers
#     and no thread there; without single-copy auto is the thread).
#  1b. scripts/scaling_check.sh: the machine, the ladder model and a deep one (32 x 128) with
#     the contention baseline, and where each stage's time goes at the largest K.
#  2. An M ladder at K = 2 on a small GPT: speed-up against 2M/(M+1), and peak
#     activation memory per rank with --remat always against never.
#  3. bench_comm: blocking MPI_Allreduce and point-to-point against what the executor
#     does with the same bytes (an activation of the ladder's model, and a GPT-2 tied
#     embedding's 154 MB), with and without single-copy.
#  3b. The sums in training (a GPT-2 sized embedding: 2 blocks x 768, vocab 50257): the tied sum at
#     K = 2 (from the later rank's start to the end, and the first stage's whole allreduce phase)
#     and the embedding's replica sum at D = 2 x K = 1 (later start to end), from the run's trace,
#     against a blocking MPI_Allreduce of the same bytes (bench_comm) in the same run.
#  4. Schedules at K = 2 (gpipe, 1f1b, zb-h1, zb-h2, interleaved with v = 2, zbv, a schedule file; zb-h1 again with
#     --in-flight 1f1b, row @1f1b; zb-h2 and zbv
#     again with --overlap-steps, rows +ov): tokens/s, measured against simulated bubble (+ov: of steps back to back),
#     peak activation memory of each rank, and the last loss (bitwise the same).
#  8. Across hosts (tests/multinode/hosts.sh: two network namespaces on this machine, half the
#     cores each, Open MPI over TCP between them): a K = 2 speed-up across the two hosts against
#     the same on one host (and across with the link shaped to RATE8=1gbit), and, with the
#     link shaped, D = 2 x K = 2 in both
#     rank orders and --rank-order auto for a model whose replica sums outweigh its
#     boundaries and one the other way round.
#  9. scripts/bench_unet.sh: a U-Net whose skips cross the cut at K = 2 (GPipe, 1F1B, zb-h1) against
#     the GPipe bound and the machine's, and its skip bytes per rank.
# Environment:
#   KS="1 2 4 8"  stages (default: those <= cores)   M=16  micro-batches of the ladder
#   LADDER_LAYERS=8  the ladder's blocks (2 with KS="1 2": one block a stage, issue 47's grain of K = 8);
#   its bubble is measured and simulated with the run's own action times
#   STEPS=5  steps per run (the first excluded: it sizes the arenas)   REPEAT=2  rounds of the ladder
#   MS="1 2 4 8 16"  the M ladder (empty: skip it)   COMM=0: skip bench_comm   LADDER=0: skip the K ladder
#   WHERE=0: skip table 1b (BUDGET1B=900 seconds for it)
#   SUMS=0: skip table 3b (STEPS3B=6 steps, the first excluded)
#   SCHEDULES=0: skip table 4 (gpipe, 1f1b, zb-h1, zb-h2, interleaved, zbv and a schedule file at K = 2, MS4="4 8",
#   ROUNDS4=1 rounds, each schedule once per round, interleaved)
#   ZB=0: skip table 5 (the quickstart GPT at K = 2, M = 4: 1f1b, zb-h1 and zb-h1 --in-flight 1f1b, ROUNDS5=3 rounds
#   of STEPS5=40 steps, each schedule once per round, interleaved; BASELINE=PATH adds that binary's 1f1b and zb-h1, rows
#   /base, each against its own 1f1b)
#   REMAT=0: skip table 6 (--remat never, selective, except-last, always, auto at K = 2, gpipe: the quickstart GPT at M = 8, a
#   GPT 4 x 128 at T 512, batch 8, M = 4, and a ResNet-18 of width 16 on 32 x 32 images, batch 32, M = 4; ROUNDS6=2 rounds,
#   interleaved; tokens/s (samples/s for the ResNet) and peak activation memory per rank against never's; auto with
#   --memory-per-rank the weights plus about half of never's peak: AUTO_Q=16.3MiB, AUTO_L=47.5MiB, AUTO_R=16MiB).
#   BASELINE=PATH adds that binary's never and always rows (an older build) to the same rounds.
#   UNET=0: skip table 9 (ROUNDS9=3 rounds)
#   HOSTS=0: skip table 8 (ROUNDS8=6 rounds of STEPS8=12 steps, interleaved; RATE8=1gbit; ORDERS8=0 skips 8b; needs root)
#   SHARD=0: skip table 7 (--shard-optimizer: resident memory per rank after the last step at D = 4 x K = 1 with AdamW and SGD,
#   sharded and not, for the quickstart GPT, a GPT 4 x 512 and a ResNet-18 (width 128, 32x32), STEPS7M=3 steps,
#   and the optimizer state that memory shows: 2 x (AdamW's - SGD's), one state vector each; then the median step
#   of STEPS7=20 at D = 2 x K = 1 sharded against unsharded, the two GPTs; ROUNDS7=4 rounds, interleaved).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
[[ -f build/release/CMakeCache.txt ]] || cmake --preset release >/dev/null
cmake --build --preset release --target mpipe bench_comm >/dev/null
cores=$(nproc)  # before OMP_NUM_THREADS=1, which nproc would report instead
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
steps=${STEPS:-5}
M=${M:-16}
repeat=${REPEAT:-2}
if [[ -z "${KS:-}" ]]; then
  KS=""
  for K in 1 2 4 8; do ((K <= cores)) && KS+="$K "; done
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
nocma=(--mca btl_vader_single_copy_mechanism none)
# The last run's $tmp/s.json (--summary), m.jsonl (--metrics) and log -> "tokens/s measured_bubble
# unit_cost_bubble simulated_bubble peak_bytes_rank0 peak_bytes_last_rank last_loss"
summarize() {
  /usr/bin/python3 - "$tmp/s.json" "$tmp/m.jsonl" "$tmp/log" <<'PY'
import json, re, sys
s = json.load(open(sys.argv[1]))
losses = [r["loss"] for r in map(json.loads, open(sys.argv[2])) if "loss" in r]
log = open(sys.argv[3]).read()
theory = float(re.search(r"schedule's theoretical ([0-9.]+)%", log).group(1)) / 100
peaks = re.search(r"peak activation memory per rank:(.*)", log).group(1).split()
units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
peak = [float(v) * units[u] for v, u in zip(peaks[::2], peaks[1::2])]
rate = s["tokens_per_s"] or s["samples_per_s"]  # images: samples/s
print(rate, s["bubble_fraction"], theory, s["simulated_bubble"], peak[0], peak[-1], repr(losses[-1]))
PY
}

# ---- 1. K ladder --------------------------------------------------------------------
if [[ "${LADDER:-1}" != 0 ]]; then
layers1=${LADDER_LAYERS:-8}
ladder=(--model gpt --layers "$layers1" --d-model 256 --heads 8 --seq-len 128 --vocab 256 --batch-size 64
        --micro-batches "$M" --threads 1 --steps "$steps" --log-every 1000000 --resume never --partition flops)
# ladder_run K LAUNCHER_ARGS... -- MPIPE_ARGS... -> "tokens_per_s bubble" from the run's summary
ladder_run() {
  local K=$1; shift
  local launcher=() args=()
  while [[ $1 != -- ]]; do launcher+=("$1"); shift; done
  shift
  args=("$@")
  mpirun -n "$K" --bind-to core "${launcher[@]}" build/release/mpipe train "${ladder[@]}" --stages "$K" \
    --summary "$tmp/s.json" "${args[@]}" > "$tmp/log"
  /usr/bin/python3 -c "import json; s = json.load(open('$tmp/s.json')); print(s['tokens_per_s'], s['bubble_fraction'], s['simulated_bubble'])"
}
echo "1. K ladder: GPT $layers1 blocks x 256 channels, seq 128, vocab 256, batch 64, M = $M; 1 thread per rank;"
echo "   tokens/s from the median step of $((steps - 1)) (the first excluded); $repeat rounds, each running K = 1 and"
echo "   then every other row once; the figure is the mean over rounds (min-max in brackets), K = 1 also after the last"
rows=()
for ((round = 0; round < repeat; ++round)); do
  read -r tps _ < <(ladder_run 1 --)
  rows+=("k1 - 1 $tps 0 0")
  for transport in single-copy none; do
    progresses="thread waits"
    [[ $transport == single-copy ]] && progresses="auto thread waits"
    for progress in $progresses; do
      for K in $KS; do
        ((K == 1)) && continue
        launcher=()
        [[ $transport == none ]] && launcher=("${nocma[@]}")
        read -r tps bubble simulated < <(ladder_run "$K" "${launcher[@]}" -- --comm-progress "$progress")
        rows+=("$transport $progress $K $tps $bubble $simulated")
      done
    done
  done
done
read -r tps _ < <(ladder_run 1 --)
rows+=("k1 - 1 $tps 0 0")
/usr/bin/python3 - "$M" "${rows[@]}" <<'PY'
import statistics, sys
M = int(sys.argv[1])
runs = {}
for row in sys.argv[2:]:
    transport, progress, K, tps, bubble, simulated = row.split()
    runs.setdefault((transport, progress, int(K)), []).append((float(tps), float(bubble), float(simulated)))
k1_runs = [t for t, _, _ in runs.pop(("k1", "-", 1))]
k1 = statistics.mean(k1_runs)
print(f"   K = 1: {k1:.0f} tokens/s [{min(k1_runs):.0f}-{max(k1_runs):.0f}]")
print(f"{'shared memory':>14} {'progress':>9} {'K':>3} {'tokens/s':>20} {'speed-up':>9} {'bound':>7} {'of bound':>9} "
      f"{'bubble':>7} {'simulated':>9} {'theory':>7}")
for (transport, progress, K), rs in runs.items():
    tps = statistics.mean(t for t, _, _ in rs)
    bubble = statistics.mean(b for _, b, _ in rs)
    simulated = statistics.mean(s for _, _, s in rs)
    spread = f"[{min(t for t, _, _ in rs):.0f}-{max(t for t, _, _ in rs):.0f}]"
    bound = K * M / (M + K - 1)
    print(f"{transport:>14} {progress:>9} {K:3d} {tps:8.0f} {spread:>11} {tps / k1:8.2f}x {bound:6.2f}x "
          f"{100 * tps / k1 / bound:8.1f}% {100 * bubble:6.1f}% {100 * simulated:8.1f}% {100 * (K - 1) / (M + K - 1):6.1f}%")
PY

fi

# ---- 1b. Where the time goes: scripts/scaling_check.sh --------------------------------
# The ladder model and a deep one (32 blocks x 128: four a stage at K = 8), the contention
# baseline (K lone K = 1 runs at once) and, at the largest K, each stage's compute, waits
# split at the neighbour's post, progress thread CPU, measured against simulated bubble.
if [[ "${WHERE:-1}" != 0 ]]; then
  echo
  echo "1b. Where the time goes (scripts/scaling_check.sh, M = $M, $((steps - 1)) timed steps a run)"
  MPIPE=build/release/mpipe KS="$KS" M="$M" STEPS="$steps" BUDGET="${BUDGET1B:-900}" bash scripts/scaling_check.sh | sed 's/^/   /'
fi

# ---- 2. M ladder at K = 2 -------------------------------------------------------------
if [[ -n "${MS-1 2 4 8 16}" ]]; then
micro=${MICRO:-4}
model=(--model gpt --layers 4 --d-model 192 --heads 6 --seq-len 128 --vocab 64 --partition flops
       --threads 1 --steps "${STEPS_M:-6}" --log-every 1000000 --lr 1e-3 --resume never)
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
echo
echo "2. M ladder at K = 2: GPT 4 blocks x 192 channels, seq 128, vocab 64, micro-batch $micro samples;"
echo "   step times: median of $((${STEPS_M:-6} - 1)) steps, averaged over two alternating runs of each K"
printf '%4s %12s %12s %9s %9s %7s %11s %11s %12s %12s\n' M "K=1 samp/s" "K=2 samp/s" speedup "bound" "of bound" \
  "bubble" "theory" "peak never" "peak always"
for M2 in ${MS-1 2 4 8 16}; do
  # K=1 and K=2 alternate, twice each, so that drifts of this machine hit both alike.
  read -r t1a _ _ < <(run 1 "$M2" never)
  read -r t2a b2a p_never < <(run 2 "$M2" never)
  read -r t1b _ _ < <(run 1 "$M2" never)
  read -r t2b b2b _ < <(run 2 "$M2" never)
  read -r _ _ p_always < <(run 2 "$M2" always)
  /usr/bin/python3 - "$M2" "$micro" "$t1a" "$t1b" "$t2a" "$t2b" "$b2a" "$b2b" "$p_never" "$p_always" <<'PY'
import sys
M, micro = int(sys.argv[1]), int(sys.argv[2])
t1a, t1b, t2a, t2b, b2a, b2b, never, always = map(float, sys.argv[3:])
t1, t2, bubble = (t1a + t1b) / 2, (t2a + t2b) / 2, (b2a + b2b) / 2
s1, s2 = M * micro / t1, M * micro / t2
bound = 2 * M / (M + 1)
mib = lambda b: f"{b / 2**20:.1f} MiB"
print(f"{M:4d} {s1:12.2f} {s2:12.2f} {s2 / s1:8.3f}x {bound:8.3f}x {100 * s2 / s1 / bound:6.1f}% "
      f"{100 * bubble:10.1f}% {100 / (M + 1):10.1f}% {mib(never):>12} {mib(always):>12}")
PY
done

# What this machine allows: two independent single-stage jobs at once, one per core,
# against one alone. The pipeline's speed-up cannot beat bound x this efficiency.
M2=8
model_solo=(build/release/mpipe train "${model[@]}" --micro-batches "$M2" --batch-size $((M2 * micro)))
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
fi

# ---- 3. communication against blocking MPI --------------------------------------------
if [[ "${COMM:-1}" != 0 ]]; then
  # The ladder's activation at K = 2: (batch / M) samples x 128 tokens x 256 channels, fp32.
  act_mb=$(/usr/bin/python3 -c "print(64 // $M * 128 * 256 * 4 / 1e6)")
  for transport in single-copy none; do
    launcher=()
    [[ $transport == none ]] && launcher=("${nocma[@]}")
    echo
    echo "3. bench_comm, 2 ranks, shared memory $transport"
    mpirun -n 2 --bind-to core "${launcher[@]}" build/release/tests/bench_comm --sizes-mb "$act_mb,154"
  done
fi

# ---- 3b. the sums in training against blocking MPI ------------------------------------------
if [[ "${SUMS:-1}" != 0 ]]; then
  steps3b=${STEPS3B:-6}
  sums_model=(--model gpt --layers 2 --d-model 768 --heads 12 --seq-len 64 --vocab 50257 --batch-size 8
              --micro-batches 4 --threads 1 --steps "$steps3b" --log-every 1000000 --resume never --lr 1e-4)
  # The embedding's bytes: its table (vocab x 768) and positions (64 x 768), fp32.
  emb_mb=$(/usr/bin/python3 -c "print((50257 + 64) * 768 * 4 / 1e6)")
  # sums_of TRACE CATEGORY [LAYER] -> "later_start_to_end_ms" (median over the traced steps): the
  # sum (of LAYER; any layer: the tie's two ends are two layers) from the later rank's post to
  # the later rank's completion
  sums_of() {
    /usr/bin/python3 - "$@" <<'PY'
import json, statistics, sys
events = json.load(open(sys.argv[1]))["traceEvents"]
steps = {}
for e in events:
    if e.get("cat") == sys.argv[2] and (len(sys.argv) < 4 or e["args"].get("layer") == int(sys.argv[3])):
        steps.setdefault(e["args"]["step"], []).append((e["ts"], e["ts"] + e["dur"]))
spans = [(max(s for s, _ in v), max(t for _, t in v)) for v in steps.values() if len(v) == 2]
print(round(statistics.median((t - s) / 1e3 for s, t in spans), 2))
PY
  }
  for transport in single-copy none; do
    launcher=()
    [[ $transport == none ]] && launcher=("${nocma[@]}")
    blocking=$(mpirun -n 2 --bind-to core "${launcher[@]}" build/release/tests/bench_comm --sizes-mb "$emb_mb" --reps 5 |
               awk '$1 == "allreduce" { print $3 }')
    mpirun -n 2 --bind-to core "${launcher[@]}" build/release/mpipe train "${sums_model[@]}" --stages 2 \
      --trace "$tmp/tied.json" --summary "$tmp/s.json" > "$tmp/log"
    tied=$(sums_of "$tmp/tied.json" "tied-weight sum")
    phase=$(/usr/bin/python3 -c "import json; print(json.load(open('$tmp/s.json'))['phase_s'][0]['allreduce'][1] * 1e3)")
    mpirun -n 2 --bind-to core "${launcher[@]}" build/release/mpipe train "${sums_model[@]}" --replicas 2 --stages 1 \
      --trace "$tmp/replica.json" --summary "$tmp/s.json" > "$tmp/log"
    replica=$(sums_of "$tmp/replica.json" "gradient sum" 0)
    echo
    echo "3b. the sums in training, GPT 2 blocks x 768, vocab 50257 (the embedding: $emb_mb MB), shared memory $transport;"
    echo "    medians over steps 2-$steps3b; ratio = time / a blocking MPI_Allreduce of the embedding's bytes ($blocking ms, bench_comm, same run)"
    /usr/bin/python3 - "$blocking" "$tied" "$phase" "$replica" <<'PY'
import sys
blocking, tied, phase, replica = map(float, sys.argv[1:])
print(f"{'sum':<66} {'ms':>9} {'ratio':>7}")
for name, ms in (("tied sum at K = 2: later rank's start to end", tied),
                 ("  the first stage's allreduce phase, mean (tied sum, norms, agreement)", phase),
                 ("replica sum of the embedding at D = 2: later start to end", replica)):
    print(f"{name:<66} {ms:9.2f} {ms / blocking:6.2f}x")
PY
  done
fi

# ---- 4. schedules at K = 2 ---------------------------------------------------------------
if [[ "${SCHEDULES:-1}" != 0 ]]; then
  sched_model=(--model gpt --layers 4 --d-model 192 --heads 6 --seq-len 128 --vocab 64 --partition flops --threads 1
               --steps "${STEPS_S:-8}" --log-every 1000000 --lr 1e-3 --resume never --remat never --clip-grad 0)
  # No clipping: with it, --overlap-steps (the +ov rows) loses its bet on every step whose norm is above the limit.
  # A schedule file between the two: stage 0 as GPipe, stage 1 as 1F1B (docs/schedules.md).
  # sched_run M SCHEDULE [OPTION...] -> summarize's line
  sched_run() {
    mpirun -n 2 --bind-to core build/release/mpipe train "${sched_model[@]}" --micro-batches "$1" \
      --batch-size $(($1 * 4)) --schedule "$2" "${@:3}" --summary "$tmp/s.json" --metrics "$tmp/m.jsonl" > "$tmp/log"
    summarize
  }
  echo
  echo "4. schedules at K = 2: GPT 4 blocks x 192 channels, seq 128, micro-batch 4 samples, no remat;"
  echo "   tokens/s of the median step of $((${STEPS_S:-8} - 1)); bubble measured (mean over steps, every rank up to the slowest's end) against"
  echo "   the schedule simulated at unit costs (F 1, B 2 = B 1 + W 1 where split) and with the run's mean action times"
  echo "   per stage; peak activation memory of rank 0 / rank 1; the last loss (the same in each M)"
  printf '%4s %-10s %10s %9s %10s %10s %21s %14s\n' M schedule tokens/s bubble "unit cost" "measured" "peak memory r0 / r1" \
    "last loss"
  for ((round = 0; round < ${ROUNDS4:-1}; ++round)); do
  for M4 in ${MS4:-4 8}; do
    {
      printf 'stage 0:'; for ((m = 0; m < M4; ++m)); do printf ' F%d' "$m"; done
      for ((m = 0; m < M4; ++m)); do printf ' B%d' "$m"; done; printf '\n'
      printf 'stage 1:'; for ((m = 0; m < M4; ++m)); do printf ' F%d B%d' "$m" "$m"; done; printf '\n'
    } > "$tmp/mixed.txt"
    for row in gpipe 1f1b zb-h1 zb-h1@1f1b zb-h2 zb-h2+ov interleaved zbv zbv+ov "file:$tmp/mixed.txt"; do
      extra=()
      schedule=${row%+ov}
      schedule=${schedule%@1f1b}
      [[ $row == *+ov ]] && extra=(--overlap-steps)
      [[ $row == *@1f1b ]] && extra=(--in-flight 1f1b)
      [[ $schedule == interleaved ]] && extra=(--virtual-stages 2)
      read -r tps bubble unit simulated peak0 peak1 loss < <(sched_run "$M4" "$schedule" "${extra[@]}")
      name=$row
      [[ $name == file:* ]] && name=file
      [[ $name == interleaved ]] && name=interl.2
      /usr/bin/python3 -c "import sys; M, n, t, b, u, s, p0, p1, l = sys.argv[1:]; print(f'{int(M):4d} {n:<10} {float(t):10.0f} {100 * float(b):8.1f}% {100 * float(u):9.1f}% {100 * float(s):9.1f}% {float(p0) / 2**20:8.1f} / {float(p1) / 2**20:5.1f} MiB {l:>14}')" \
        "$M4" "$name" "$tps" "$bubble" "$unit" "$simulated" "$peak0" "$peak1" "$loss"
    done
  done
  done
fi

# ---- 5. zero bubble against 1F1B on the quickstart GPT --------------------------------------
if [[ "${ZB:-1}" != 0 ]]; then
  rounds5=${ROUNDS5:-3}
  echo
  echo "5. zero bubble against 1F1B: inputs/quickstart.toml (GPT 4 blocks x 128 channels, seq 64, vocab 256), K = 2,"
  echo "   M = 4, ${STEPS5:-40} steps; $rounds5 rounds, each schedule once per round; bubble measured (mean over steps and"
  echo "   rounds, [min-max] of the rounds' means) and simulated with the run's action times; peak activation memory"
  echo "   of rank 0 / rank 1; zb-h1@1f1b is --in-flight 1f1b (what 1F1B holds on each rank)"
  rows5=()
  for ((round = 0; round < rounds5; ++round)); do
    for row in 1f1b zb-h1 zb-h1@1f1b ${BASELINE:+1f1b/base zb-h1/base}; do
      extra=()
      [[ $row == *@1f1b ]] && extra=(--in-flight 1f1b)
      binary=build/release/mpipe
      [[ $row == */base ]] && binary=$BASELINE
      schedule=${row%@1f1b}
      mpirun -n 2 --bind-to core "$binary" train --config inputs/quickstart.toml --steps "${STEPS5:-40}" \
        --threads 1 --log-every 1000000 --resume never --schedule "${schedule%/base}" "${extra[@]}" \
        --summary "$tmp/s.json" --metrics "$tmp/m.jsonl" > "$tmp/log"
      rows5+=("$row $(summarize)")
    done
  done
  /usr/bin/python3 - "${rows5[@]}" <<'PY'
import statistics, sys
runs = {}
for row in sys.argv[1:]:
    name, *values = row.split()
    runs.setdefault(name, []).append(values)
# Each binary's rows against its own 1F1B (a BASELINE binary's rows end in /base).
def of_1f1b(name):
    return runs["1f1b/base" if name.endswith("/base") else "1f1b"]
base_of = lambda name: statistics.mean(float(v[1]) for v in of_1f1b(name))
base_peak_of = lambda name: max(max(float(v[4]), float(v[5])) for v in of_1f1b(name))
print(f"{'schedule':<11} {'tokens/s':>9} {'bubble':>18} {'of 1f1b':>8} {'simulated':>10} {'peak r0 / r1':>18} "
      f"{'peak of 1f1b':>13} {'last loss':>12}")
for name, vs in runs.items():  # each: tokens/s, bubble, unit-cost bubble, simulated, peak r0, peak r1, last loss
    bubbles = [float(v[1]) for v in vs]
    peak0, peak1 = max(float(v[4]) for v in vs), max(float(v[5]) for v in vs)
    losses = {v[6] for v in vs}
    print(f"{name:<11} {statistics.mean(float(v[0]) for v in vs):9.0f} {100 * statistics.mean(bubbles):6.1f}% "
          f"[{100 * min(bubbles):4.1f}-{100 * max(bubbles):4.1f}] {statistics.mean(bubbles) / base_of(name):7.2f}x "
          f"{100 * statistics.mean(float(v[3]) for v in vs):9.1f}% {peak0 / 2**20:7.1f} / {peak1 / 2**20:4.1f} MiB "
          f"{max(peak0, peak1) / base_peak_of(name):12.2f}x {'/'.join(sorted(losses)):>12}")
PY
fi

# ---- 6. re-materialization: what each --remat mode costs and saves ----------------------
if [[ "${REMAT:-1}" != 0 ]]; then
  rounds6=${ROUNDS6:-2}
  echo
  echo "6. --remat at K = 2, gpipe, one thread per rank: tokens/s of the median step and peak activation memory"
  echo "   of rank 0 / rank 1, each against --remat never of the same model; $rounds6 rounds, interleaved"
  echo "   (base: ${BASELINE:-none} as a baseline binary, its rows marked 'base')"
  quick=(--config inputs/quickstart.toml --micro-batches 8 --steps "${STEPS6Q:-40}")
  long=(--model gpt --layers 4 --d-model 128 --heads 4 --seq-len 512 --vocab 256 --batch-size 8 --micro-batches 4
        --steps "${STEPS6L:-10}")
  resnet=(--model resnet --layers 18 --width 16 --image 32 --batch-size 32 --micro-batches 4 --steps "${STEPS6R:-12}")
  # auto's limit: each model's weights on its larger rank plus about half of never's peak activations
  declare -A auto_limit=([quick]="${AUTO_Q:-16.3MiB}" [long]="${AUTO_L:-47.5MiB}" [resnet]="${AUTO_R:-16MiB}")
  rows6=()
  for ((round = 0; round < rounds6; ++round)); do
    for model in quick long resnet; do
      declare -n args6=$model
      for row in never selective except-last always auto ${BASELINE:+base:never base:always}; do
        binary=build/release/mpipe
        [[ $row == base:* ]] && binary=$BASELINE
        limit=()
        [[ $row == auto ]] && limit=(--memory-per-rank "${auto_limit[$model]}")
        mpirun -n 2 --bind-to core "$binary" train "${args6[@]}" --threads 1 --log-every 1000000 --resume never \
          --schedule gpipe --remat "${row#base:}" "${limit[@]}" --summary "$tmp/s.json" --metrics "$tmp/m.jsonl" > "$tmp/log"
        rows6+=("$model $row $(summarize)")
      done
      unset -n args6
    done
  done
  /usr/bin/python3 - "${rows6[@]}" <<'PY'
import statistics, sys
runs = {}
for row in sys.argv[1:]:
    model, mode, *v = row.split()
    runs.setdefault((model, mode), []).append(v)
names = {"quick": "quickstart GPT, M=8", "long": "GPT 4x128, T 512, M=4", "resnet": "ResNet-18 w16, M=4"}
print(f"{'model':<22} {'remat':<16} {'tokens/s':>9} {'of never':>9} {'peak r0 / r1':>20} {'of never':>9} {'last loss':>12}"
      "   (the ResNet's in samples/s)")
for (model, mode), vs in runs.items():
    never = runs[(model, "never")]
    tps = statistics.mean(float(v[0]) for v in vs)
    base_tps = statistics.mean(float(v[0]) for v in never)
    peak = max(max(float(v[4]), float(v[5])) for v in vs)
    base_peak = max(max(float(v[4]), float(v[5])) for v in never)
    p0, p1 = max(float(v[4]) for v in vs), max(float(v[5]) for v in vs)
    print(f"{names[model]:<22} {mode:<16} {tps:9.0f} {tps / base_tps:8.2f}x {p0 / 2**20:8.1f} / {p1 / 2**20:5.1f} MiB "
          f"{peak / base_peak:8.2f}x {'/'.join(sorted({v[6] for v in vs})):>12}")
PY
fi

# ---- 7. the optimizer sharded over replicas (ZeRO-1) -------------------------------------
if [[ "${SHARD:-1}" != 0 ]]; then
  rounds7=${ROUNDS7:-4}
  echo
  echo "7. --shard-optimizer: resident memory per rank after the last step at D = 4 x K = 1 (4 ranks; least / most over ranks and"
  echo "   $rounds7 rounds), the optimizer state it shows (2 x (AdamW - SGD): AdamW keeps two vectors, SGD one) against"
  echo "   the allocated figure, and the median step at D = 2 x K = 1 (2 ranks, a core each), sharded against not"
  quick7=(--config inputs/quickstart.toml --micro-batches 1)
  wide7=(--model gpt --layers 4 --d-model 512 --heads 8 --seq-len 64 --vocab 256 --batch-size 8 --micro-batches 1)
  resnet7=(--model resnet --layers 18 --width 128 --image 32 --batch-size 16 --micro-batches 1)
  rows7=()
  for ((round = 0; round < rounds7; ++round)); do
    for model in quick7 wide7 resnet7; do
      declare -n args7=$model
      for optimizer in adamw sgd; do
        for shard in no yes; do
          flag=()
          [[ $shard == yes ]] && flag=(--shard-optimizer)
          mpirun -n 4 --oversubscribe build/release/mpipe train "${args7[@]}" --replicas 4 --steps "${STEPS7M:-3}" \
            --threads 1 --log-every 1000000 --resume never --optimizer "$optimizer" "${flag[@]}" > "$tmp/log" 2>&1
          # (the run's own line: each rank's resident memory after its last step, /proc/self/statm, without a
          # step's transient buffers: Open MPI's non-blocking allreduce allocates its own, a gradient's worth at
          # once, which made peak figures of the same run differ by a whole state vector) -> least and most, KiB
          rss=$(grep '^resident memory per rank after the last step:' "$tmp/log" |
                awk -F: '{n = split($2, a, " "); for (i = 1; i < n; i += 2) print a[i] * (a[i+1] == "GiB" ? 1048576 : a[i+1] == "MiB" ? 1024 : 1)}' |
                sort -n | awk 'NR == 1 {l = $1} {h = $1} END {printf "%d %d", l, h}')
          state=$(grep -o 'gradients + [a-z]* state[^:]*: [0-9.]* [KMG]i*B + [0-9.]* [KMG]i*B' "$tmp/log" | awk '{print $(NF-1), $NF}')
          rows7+=("mem $model $optimizer $shard $rss $state")
        done
      done
      [[ $model == resnet7 ]] && { unset -n args7; continue; }
      for shard in no yes; do
        flag=()
        [[ $shard == yes ]] && flag=(--shard-optimizer)
        mpirun -n 2 --bind-to core build/release/mpipe train "${args7[@]}" --replicas 2 --micro-batches 2 --threads 1 \
          --steps "${STEPS7:-20}" \
          --log-every 1000000 --resume never "${flag[@]}" --summary "$tmp/s.json" > "$tmp/log"
        rows7+=("time $model x $shard $(/usr/bin/python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["step_time_s"])' "$tmp/s.json")")
      done
      unset -n args7
    done
  done
  /usr/bin/python3 - "${rows7[@]}" <<'PY'
import statistics, sys
names = {"quick7": "quickstart GPT", "wide7": "GPT 4x512, T 64", "resnet7": "ResNet-18 w128 32x32"}
units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
mem, time = {}, {}
for row in sys.argv[1:]:
    kind, model, optimizer, shard, *v = row.split()
    if kind == "mem":
        mem.setdefault((model, optimizer, shard), []).append((float(v[0]) * 1024, float(v[1]) * 1024, float(v[2]) * units[v[3]]))
    else:
        time.setdefault((model, shard), []).append(float(v[0]))
print(f"{'model':<21} {'sharded':<8} {'AdamW RSS least/most':>22} {'SGD RSS least/most':>20} {'state (RSS)':>12} "
      f"{'of unsharded':>13} {'allocated':>10} {'of unsharded':>13}")
for model in names:
    if (model, "adamw", "no") not in mem:
        continue
    base = None
    for shard in ("no", "yes"):
        a, s = mem[(model, "adamw", shard)], mem[(model, "sgd", shard)]
        least = lambda runs: min(r[0] for r in runs)
        most = lambda runs: max(r[1] for r in runs)
        state = 2 * (least(a) - least(s))
        allocated = a[0][2]
        if shard == "no":
            base = (state, allocated)
        print(f"{names[model]:<21} {shard:<8} {least(a) / 2**20:10.1f} / {most(a) / 2**20:6.1f} MiB {least(s) / 2**20:8.1f} / "
              f"{most(s) / 2**20:6.1f} MiB {state / 2**20:8.1f} MiB {state / base[0]:12.3f}x {allocated / 2**20:6.1f} MiB "
              f"{allocated / base[1]:12.3f}x")
print()
print(f"{'model (D = 2 x K = 1)':<22} {'unsharded step':>15} {'sharded step':>13} {'ratio':>7}")
for model in names:
    if (model, "no") not in time:
        continue
    plain, sharded = statistics.median(time[(model, "no")]), statistics.median(time[(model, "yes")])
    print(f"{names[model]:<22} {plain * 1e3:12.1f} ms {sharded * 1e3:10.1f} ms {sharded / plain:6.3f}x")
PY
fi

# ---- 8. across hosts --------------------------------------------------------------------
if [[ "${HOSTS:-1}" != 0 ]]; then
  echo
  hosts8=tests/multinode/hosts.sh
  # The hosts go when the script ends, however it ends (shaped links with them).
  trap 'bash "$hosts8" down > /dev/null 2>&1; rm -rf "$tmp"' EXIT
  if ! bash "$hosts8" up 2 > "$tmp/hosts.log" 2>&1; then
    echo "8. across hosts: skipped ($(tail -1 "$tmp/hosts.log"))"
  else
  rounds8=${ROUNDS8:-6}
  steps8=${STEPS8:-12}
  mapfile -t across8 < <(bash "$hosts8" mpirun-args)
  mapfile -t names8 < <(bash "$hosts8" names)
  two8=(--host "${names8[0]}:1,${names8[1]}:1")
  ladder8=(--model gpt --layers 8 --d-model 128 --heads 4 --seq-len 128 --vocab 256 --batch-size 16 --micro-batches 8
           --threads 1 --steps "$steps8" --log-every 1000000 --resume never --partition flops)
  echo "8. across hosts: two test hosts (network namespaces, $(($(nproc --all) / 2)) core(s) each, TCP over a veth link), $rounds8 rounds, interleaved;"
  echo "   the median step of $((steps8 - 1)) (the first excluded)"
  echo "8a. K = 2 across the hosts against K = 2 on one (GPT 8 x 128, seq 128, batch 16, M = 8): speed-up over K = 1 and"
  echo "    its ratio; per round, across / one host, whose median is the figure (K = 1 cancels in the round)"
  run8() {  # run8 NAME LAUNCHER... -- MPIPE_ARGS... -> a row "NAME tokens/s"
    local name=$1; shift
    local launcher=()
    while [[ $1 != -- ]]; do launcher+=("$1"); shift; done
    shift
    timeout 600 mpirun "${launcher[@]}" build/release/mpipe train "$@" --summary "$tmp/s8.json" > "$tmp/log8" 2>&1 \
      || { echo "   $name failed: $(grep -m1 error "$tmp/log8")" >&2; return; }
    /usr/bin/python3 -c "import json; print('$name', json.load(open('$tmp/s8.json'))['tokens_per_s'])"
  }
  rows8=()
  for ((round = 0; round < rounds8; ++round)); do
    rows8+=("$(run8 k1 -n 1 --bind-to core -- "${ladder8[@]}")")
    rows8+=("$(run8 one -n 2 --bind-to core -- "${ladder8[@]}" --stages 2)")
    rows8+=("$(run8 across -n 2 "${across8[@]}" "${two8[@]}" -- "${ladder8[@]}" --stages 2)")
    rows8+=("$(run8 across-waits -n 2 "${across8[@]}" "${two8[@]}" -- "${ladder8[@]}" --stages 2 --comm-progress waits)")
    bash "$hosts8" shape "${RATE8:-1gbit}"
    rows8+=("$(run8 across-shaped -n 2 "${across8[@]}" "${two8[@]}" -- "${ladder8[@]}" --stages 2)")
    bash "$hosts8" unshape
  done
  /usr/bin/python3 - "${rows8[@]}" <<'PY'
import statistics, sys
runs = {}
for row in sys.argv[1:]:
    if row:
        name, tps = row.split()
        runs.setdefault(name, []).append(float(tps))
k1 = statistics.median(runs["k1"])
print(f"{'':>4}{'run':<42} {'tokens/s':>9} {'speed-up':>9} {'across / one host':>18}")
names = {"k1": "K = 1", "one": "K = 2, one host", "across": "K = 2 across hosts",
         "across-waits": "K = 2 across hosts, --comm-progress waits", "across-shaped": "K = 2 across hosts, link shaped"}
for name in ("k1", "one", "across", "across-waits", "across-shaped"):
    t = runs.get(name, [])
    if not t:
        continue
    ratio = ""
    if name.startswith("across") and len(t) == len(runs["one"]):
        r = [a / b for a, b in zip(t, runs["one"])]
        ratio = f"{statistics.median(r):.3f} [{min(r):.2f}-{max(r):.2f}]"
    print(f"{'':>4}{names[name]:<42} {statistics.median(t):9.0f} {statistics.median(t) / k1:8.2f}x {ratio:>18}")
PY
  if [[ "${ORDERS8:-1}" != 0 ]]; then
  rate8=${RATE8:-1gbit}
  echo "8b. D = 2 x K = 2 on the two hosts (two ranks each, sharing its core), the link shaped to $rate8 each way (tc tbf):"
  echo "    median step per rank order, against the better of the two; auto's choice and the bytes it predicted"
  wide8=(--model gpt --layers 4 --d-model 256 --heads 4 --seq-len 16 --vocab 256 --batch-size 8 --micro-batches 4)
  long8=(--model gpt --layers 4 --d-model 32 --heads 4 --seq-len 512 --vocab 64 --batch-size 32 --micro-batches 4)
  bash "$hosts8" shape "$rate8"
  rows8=()
  for ((round = 0; round < rounds8; ++round)); do
    for model in wide8 long8; do
      declare -n args8=$model
      for order in pipeline data auto; do
        timeout 600 mpirun -n 4 --oversubscribe "${across8[@]}" --host "${names8[0]}:2,${names8[1]}:2" build/release/mpipe train \
          "${args8[@]}" --replicas 2 --rank-order "$order" --threads 1 --steps "$steps8" --log-every 1000000 --resume never \
          --summary "$tmp/s8.json" > "$tmp/log8" 2>&1 || { echo "   $model $order failed: $(grep -m1 error "$tmp/log8")" >&2; continue; }
        chosen=$(grep -o "^grid: .*rank order [a-z]*" "$tmp/log8" | awk '{print $NF}')
        rows8+=("$model $order $chosen $(/usr/bin/python3 -c "import json; print(json.load(open('$tmp/s8.json'))['step_time_s'])")")
        [[ $order == auto ]] && grep "^rank order" "$tmp/log8" > "$tmp/why-$model" || true
      done
    done
  done
  bash "$hosts8" unshape
  /usr/bin/python3 - "$tmp" "${rows8[@]}" <<'PY'
import statistics, sys
tmp = sys.argv[1]
runs, chosen = {}, {}
for row in sys.argv[2:]:
    model, order, got, step = row.split()
    runs.setdefault((model, order), []).append(float(step))
    if order == "auto":
        chosen[model] = got
names = {"wide8": "GPT 4 x 256, seq 16 (sums large)", "long8": "GPT 4 x 32, seq 512 (boundaries large)"}
print(f"{'':>4}{'model':<40} {'pipeline':>10} {'data':>10} {'auto':>16} {'auto / best':>12}")
for model in ("wide8", "long8"):
    med = {o: statistics.median(runs[(model, o)]) for o in ("pipeline", "data", "auto") if (model, o) in runs}
    if len(med) < 3:
        continue
    best = min(med["pipeline"], med["data"])
    print(f"{'':>4}{names[model]:<40} {med['pipeline'] * 1e3:8.1f}ms {med['data'] * 1e3:8.1f}ms "
          f"{med['auto'] * 1e3:7.1f}ms ({chosen.get(model, '?'):>8}) {med['auto'] / best:11.3f}x")
    try:
        print(f"{'':>8}{open(f'{tmp}/why-{model}').read().strip()}")
    except OSError:
        pass
PY
  fi
  fi
fi

# ---- 9. a network that is not a chain: scripts/bench_unet.sh ---------------------------------
# The U-Net of inputs/unet.toml at K = 2 with both skips across the cut: speed-up against
# K = 1 beside the GPipe bound and the machine's (two K = 1 runs at once), for GPipe, 1F1B
# and zb-h1, measured against simulated bubble, and each rank's skip bytes.
if [[ "${UNET:-1}" != 0 ]]; then
  echo
  echo "9. U-Net at K = 2, skips across the cut (scripts/bench_unet.sh, ${ROUNDS9:-3} rounds interleaved)"
  MPIPE=build/release/mpipe ROUNDS="${ROUNDS9:-3}" bash scripts/bench_unet.sh | sed 's/^/   /'
fi
