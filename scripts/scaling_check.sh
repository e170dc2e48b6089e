#!/usr/bin/env bash
# The CPU K ladder that says where the time goes, in one call (issue 47): made for a lent
# 16-core machine (at most 5 minutes there), and as useful on 2 cores (KS="1 2").
#   1. the machine: lscpu (cores, SMT siblings, NUMA), ptrace_scope, and whether Open MPI's
#      single-copy (CMA) works between two ranks here;
#   2. for two GPTs, T 128, vocab 256, batch 64, M (32), one BLAS thread a rank, gpipe:
#      "ladder" 8 blocks x 256 (one block a stage at K = 8) and "deep" 32 blocks x 128
#      (four a stage at K = 8): tokens/s for each K, the speed-up over K = 1 against the
#      GPipe bound K·M/(M+K−1), and against the machine's own bound from the contention
#      baseline: K independent K = 1 runs at once, one a physical core, whose slowest
#      rate against a lone K = 1 run is what the machine gives K busy cores (a pipeline of
#      equal stages goes at its slowest core's pace: a VM's cores can differ by 25%)
#      (bound = K · slowest_rate_concurrent / rate_alone · M / (M+K−1));
#   3. for the largest K of each model (and K without single-copy for the ladder model), a
#      traced run through scripts/ladder_report.py: per stage compute, p2p wait split at
#      the neighbour's post (late neighbour / after the post: transfer and unseen), the
#      progress thread's CPU share, measured against simulated bubble.
# Every run is under `timeout`; the whole is bounded by BUDGET seconds (default 290): a run
# with under 15 s left is skipped and said so. The last lines are machine-readable:
#   RESULT MODEL K speedup bound machine_bound
# Environment: KS="1 2 4 8" (default: those <= physical cores), CONTENTION_KS (default: the
# two largest of KS), M=32, STEPS=4 (the first excluded), MODELS="ladder deep", BUDGET=290,
# MPIPE=build/release/mpipe.
# Usage: scripts/scaling_check.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
mpipe=${MPIPE:-build/release/mpipe}
[[ -x $mpipe ]] || { echo "scaling_check.sh: no $mpipe (build first: cmake --build --preset release)" >&2; exit 2; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
py=/usr/bin/python3
[[ -x $py ]] || py=python3
M=${M:-32}
steps=${STEPS:-4}
budget=${BUDGET:-290}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$SECONDS
left() { echo $((budget - (SECONDS - start))); }

# ---- 1. the machine ----------------------------------------------------------------------
echo "## 1. The machine"
lscpu | grep -E "^(Model name|CPU\(s\)|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\)|NUMA node)" | sed 's/^/    /'
# One logical CPU list per physical core ("0,64" with SMT): what --bind-to core gives a rank.
mapfile -t core_cpus < <(lscpu -p=CORE,CPU 2>/dev/null | grep -v '^#' | $py -c "
import sys, collections
cores = collections.OrderedDict()
for line in sys.stdin:
    core, cpu = line.strip().split(',')
    cores.setdefault(core, []).append(cpu)
for cpus in cores.values(): print(','.join(cpus))")
physical=${#core_cpus[@]}
((physical > 0)) || { physical=$(nproc); core_cpus=(); for ((c = 0; c < physical; ++c)); do core_cpus+=("$c"); done; }
echo "    physical cores: $physical (first: ${core_cpus[0]}; a rank bound to a core holds all its SMT siblings)"
echo "    kernel.yama.ptrace_scope: $(cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null || echo 'not set') (1 or more keeps CMA from non-children)"
tiny=(train --model gpt --layers 2 --d-model 64 --heads 2 --seq-len 64 --vocab 256 --batch-size 64 --micro-batches 2 --threads 1
      --steps 2 --log-every 1000 --resume never --stages 2 --progress off)
if out=$(timeout 60 mpirun -n 2 --bind-to none --mca btl_vader_single_copy_mechanism cma "$mpipe" "${tiny[@]}" 2>&1) &&
   ! grep -qiE "single.copy|process_vm_readv|errno" <<<"$out"; then
  echo "    Open MPI single-copy (CMA): works"
else
  echo "    Open MPI single-copy (CMA): does NOT work here (transfers then need both ranks' progress):"
  grep -iE "single.copy|process_vm|errno|error" <<<"$out" | head -3 | sed 's/^/      /'
fi

if [[ -z ${KS:-} ]]; then
  KS=""
  for K in 1 2 4 8; do ((K <= physical)) && KS+="$K "; done
fi
read -r -a ks <<<"$KS"
largest=${ks[-1]}

model_args() {  # model_args NAME
  case $1 in
    ladder) echo "--layers 8 --d-model 256 --heads 8" ;;
    deep) echo "--layers 32 --d-model 128 --heads 4" ;;
  esac
}
# run NAME OUT K [MPIRUN ARGS...] -- [MPIPE ARGS...]: one run under the budget; its summary in OUT.
run() {
  local name=$1 out=$2 K=$3; shift 3
  local launcher=()
  while [[ $1 != -- ]]; do launcher+=("$1"); shift; done
  shift
  local t; t=$(left)
  ((t >= 15)) || { echo "    (skipped $name K=$K: $t s of the budget left)"; return 1; }
  rm -f "$out"
  # shellcheck disable=SC2046
  timeout "$((t < 120 ? t : 120))" mpirun -n "$K" "${launcher[@]}" "$mpipe" train --model gpt $(model_args "$name") \
    --seq-len 128 --vocab 256 --batch-size 64 --micro-batches "$M" --threads 1 --steps "$steps" --log-every 1000000 \
    --resume never --partition flops --progress off --stages "$K" --summary "$out" "$@" > "$out.log" 2>&1
  [[ -s $out ]] || { echo "    ($name K=$K failed: $(grep -m1 -i error "$out.log" | cut -c1-120))"; return 1; }
}
rate() { $py -c "import json,sys; print(json.load(open(sys.argv[1]))['tokens_per_s'])" "$1"; }

results=()
for name in ${MODELS:-ladder deep}; do
  echo
  echo "## 2. $name: GPT $(model_args "$name" | awk '{print $2 " blocks x " $4}'), T 128, batch 64, M = $M, 1 thread a rank"
  # The contention baseline: K lone K = 1 runs at once, each bound to its own physical core.
  declare -A alone=() together=() together_mean=()
  run "$name" "$work/$name-1.json" 1 --bind-to core -- && alone[1]=$(rate "$work/$name-1.json")
  for K in ${CONTENTION_KS:-${ks[*]: -2}}; do
    ((K > 1)) || continue
    ((K <= physical)) || continue
    t=$(left)
    if ((t < 20)); then echo "    (skipped the contention baseline at K=$K: $t s left)"; continue; fi
    pids=()
    for ((i = 0; i < K; ++i)); do
      # shellcheck disable=SC2046
      taskset -c "${core_cpus[$i]}" timeout "$((t < 120 ? t : 120))" mpirun -n 1 --bind-to none "$mpipe" train --model gpt \
        $(model_args "$name") --seq-len 128 --vocab 256 --batch-size 64 --micro-batches "$M" --threads 1 --steps "$steps" \
        --log-every 1000000 --resume never --progress off --summary "$work/$name-c$K-$i.json" > /dev/null 2>&1 &
      pids+=($!)
    done
    wait "${pids[@]}"
    read -r "together[$K]" "together_mean[$K]" < <($py -c "
import json, sys
rates = [json.load(open(p))['tokens_per_s'] for p in sys.argv[1:]]
print(min(rates), sum(rates) / len(rates))" "$work/$name-c$K-"*.json 2>/dev/null)
  done
  printf '    %-3s %10s %9s %8s %9s %13s %9s\n' K tokens/s speed-up bound "of bound" "machine bound" "of it"
  for K in "${ks[@]}"; do
    if ((K == 1)); then
      [[ -n ${alone[1]:-} ]] && printf '    %-3s %10.0f %8.2fx\n' 1 "${alone[1]}" 1
      continue
    fi
    run "$name" "$work/$name-$K.json" "$K" --bind-to core -- || continue
    [[ -n ${alone[1]:-} ]] || continue
    read -r speedup bound machine < <($py -c "
import sys
K, M, rate, alone = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
together = float(sys.argv[5]) if sys.argv[5] else 0
bound = K * M / (M + K - 1)
machine = K * together / alone * M / (M + K - 1) if together else 0
print(f'{rate / alone:.3f} {bound:.3f} {machine:.3f}')" "$K" "$M" "$(rate "$work/$name-$K.json")" "${alone[1]}" "${together[$K]:-}")
    printf '    %-3s %10.0f %8.2fx %7.2fx %8.0f%% %12s %9s\n' "$K" "$(rate "$work/$name-$K.json")" "$speedup" "$bound" \
      "$($py -c "print(100 * $speedup / $bound)")" \
      "$( [[ $machine != 0.000 ]] && printf '%.2fx' "$machine" || echo -)" \
      "$( [[ $machine != 0.000 ]] && $py -c "print(f'{100 * $speedup / $machine:.0f}%')" || echo -)"
    results+=("RESULT $name $K $speedup $bound $machine")
  done
  for K in "${ks[@]}"; do
    [[ -n ${together[$K]:-} && -n ${alone[1]:-} ]] &&
      echo "    contention at K=$K: $K lone K=1 runs at once give $($py -c "print(f'{${together[$K]} / ${alone[1]}:.3f}x (the slowest), {${together_mean[$K]} / ${alone[1]}:.3f}x (their mean)')") a lone one's rate"
  done
  unset alone together together_mean
  # 3. Where the time goes at the largest K (and without single-copy for the ladder model).
  ((largest > 1)) || continue
  echo
  echo "## 3. $name at K = $largest: where the time goes (traced run; scripts/ladder_report.py)"
  variants=(single-copy)
  [[ $name == ladder ]] && variants+=(none)
  for transport in "${variants[@]}"; do
    launcher=(--bind-to core)
    [[ $transport == none ]] && launcher+=(--mca btl_vader_single_copy_mechanism none)
    run "$name" "$work/$name-t.json" "$largest" "${launcher[@]}" -- --trace "$work/$name-t.trace.json" \
      --trace-steps $((steps - 1)) || continue
    $py scripts/ladder_report.py "$work/$name-t.json" "$work/$name-t.trace.json" "$name K=$largest $transport" | sed 's/^/    /'
  done
done
echo
printf '%s\n' "${results[@]}"
echo "scaling_check.sh: $((SECONDS - start)) s"
