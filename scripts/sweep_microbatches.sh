#!/usr/bin/env bash
# Sweeps the micro-batch count M (and schedules) with mpirun on this machine and writes
# one CSV row per run: M, schedule, K, D, samples/s, step time, measured and theoretical
# bubble, peak activation memory per rank; plus a K=1 baseline per M for the bound.
# Usage: scripts/sweep_microbatches.sh [--ms "1 2 4 8 16"] [--schedules "gpipe 1f1b zb-h1 interleaved:2"]
#          [--ranks N] [--replicas D] [--micro-size S] [--out sweep.csv]
#          [--slurm CONFIG.toml] [-- extra mpipe train options]
# With --slurm, nothing runs here: one job array per schedule is submitted
# (slurm/sweep-microbatches.sbatch, one array task per M, --ntasks-per-node=ranks),
# its tasks append their rows to the same CSV and log beside it.
# The global batch is M x D x micro-size, so every run has micro-batches of one size.
# interleaved:V runs --schedule interleaved --virtual-stages V (an M that is not a multiple
# of the stages is skipped for it, with a line on stderr); its CSV rows say interleaved:V.
# Runs with --overlap-steps (after --) say +ov after the schedule, e.g. zb-h2+ov.
# Then: /usr/bin/python3 scripts/plot_sweep.py sweep.csv sweep.png
set -euo pipefail
cd "$(dirname "$0")/.."
ms="1 2 4 8 16" schedules="gpipe" ranks=$(nproc) micro=4 out=sweep.csv replicas=1 slurm_config=
while [[ $# -gt 0 ]]; do
  case $1 in
    --ms) ms=$2; shift 2 ;;
    --schedules) schedules=$2; shift 2 ;;
    --ranks) ranks=$2; shift 2 ;;
    --replicas) replicas=$2; shift 2 ;;
    --micro-size) micro=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --slurm) slurm_config=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "sweep_microbatches.sh: unknown argument '$1'; hint: see the usage at the top of the script" >&2; exit 2 ;;
  esac
done
extra=("$@")
if [[ -n "$slurm_config" ]]; then
  read -r -a list <<< "$ms"
  for schedule in $schedules; do
    MS="$ms" SCHEDULE=$schedule REPLICAS=$replicas MICRO_SIZE=$micro SWEEP_CSV=$(readlink -f "$out") \
      sbatch --array=0-$((${#list[@]} - 1)) --ntasks-per-node="$ranks" \
      -o "$(dirname "$(readlink -f "$out")")/mpipe-sweep-%A_%a.out" slurm/sweep-microbatches.sbatch \
      "$slurm_config" "${extra[@]}"
  done
  echo "submitted; rows go to $out as the array tasks finish"
  exit 0
fi
# The release build's binary, else an mpipe on PATH (the manual's examples put one there), else build it.
mpipe=build/release/mpipe
[[ -x $mpipe ]] || ! command -v mpipe >/dev/null || mpipe=$(command -v mpipe)
[[ -x $mpipe ]] || { bash scripts/setup.sh; cmake --preset release >/dev/null; cmake --build --preset release --target mpipe >/dev/null; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
bind=(--bind-to core)
(( ranks > $(nproc) )) && bind=(--oversubscribe --bind-to none)

run() {  # ranks schedule[:virtual stages] M -> summary JSON line
  local n=$1 schedule=${2%%:*} v=1 M=$3 D=$4
  [[ $2 == *:* ]] && v=${2#*:}
  mpirun -n "$n" "${bind[@]}" "$mpipe" train --threads 1 --log-every 1000000 "${extra[@]}" \
    --schedule "$schedule" --virtual-stages "$v" --micro-batches "$M" --replicas "$D" --batch-size $((M * D * micro)) \
    --summary "$tmp/summary.json" > "$tmp/log" || { cat "$tmp/log" >&2; exit 1; }
  cat "$tmp/summary.json"
}

echo "M,schedule,K,D,samples_per_s,step_time_s,bubble,theoretical_bubble,baseline_samples_per_s,peak_bytes_per_rank" > "$out"
for M in $ms; do
  base=$(run "$replicas" gpipe "$M" "$replicas")
  for schedule in $schedules; do
    if [[ $schedule == interleaved* ]] && (( M % (ranks / replicas) != 0 )); then
      echo "M=$M: $schedule needs a multiple of the $((ranks / replicas)) stages; skipped" >&2
      continue
    fi
    line=$(run "$ranks" "$schedule" "$M" "$replicas")
    /usr/bin/python3 - "$line" "$base" >> "$out" <<'PY'
import json, sys
s, b = json.loads(sys.argv[1]), json.loads(sys.argv[2])
v = s.get("virtual_stages", 1)
print(f"{s['micro_batches']},{s['schedule']}{f':{v}' if v > 1 else ''}{'+ov' if s.get('overlap_steps') else ''},{s['stages']},{s['replicas']},{s['samples_per_s']:.6g},"
      f"{s['step_time_s']:.6g},{s['bubble_fraction']:.6g},{s['theoretical_bubble']:.6g},{b['samples_per_s']:.6g},"
      + ";".join(str(p) for p in s["peak_activation_bytes_per_rank"]))
PY
    tail -1 "$out"
  done
done
echo "wrote $out"
