#!/usr/bin/env bash
# mpipe against PyTorch (Debian's python3-torch) on this machine: median training-step
# time of the same model with the same threads, micro-batches, AdamW and clipping.
# Prints a table; the target is mpipe <= 0.9x PyTorch's step time.
#   STEPS=N  steps per measurement (default 30; the first 3 are excluded)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
[[ -f build/release/CMakeCache.txt ]] || cmake --preset release >/dev/null
cmake --build --preset release --target mpipe >/dev/null
steps=${STEPS:-30}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Median step time (s) of an mpipe run, from its metrics file, first 3 steps excluded.
mpipe_median() {
  build/release/mpipe train --steps "$steps" --log-every 1000000 --metrics "$tmp/m.jsonl" "$@" >/dev/null
  /usr/bin/python3 - "$tmp/m.jsonl" <<'PY'
import json, statistics, sys
t = [r["step_time_s"] for r in map(json.loads, open(sys.argv[1])) if "step" in r][3:]  # not the summary line
print(f"{statistics.median(t):.6f}")
PY
}

printf '%-34s %7s %12s %12s %8s\n' "model" threads "mpipe ms" "pytorch ms" ratio
row() {
  local name=$1 threads=$2 mp=$3 pt=$4
  /usr/bin/python3 -c "print(f'%-34s %7s %12.2f %12.2f %8.3f' % ('$name', $threads, $mp*1e3, $pt*1e3, $mp/$pt))"
}
mlp=(--model mlp --layers 4 --hidden 1024 --inputs 1024 --classes 16 --batch-size 256 --micro-batches 1)
for threads in 1 2; do
  export OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads
  mp=$(mpipe_median "${mlp[@]}" --threads "$threads" --weight-decay 0.01)
  pt=$(/usr/bin/python3 scripts/bench_cpu.py "${mlp[@]}" --threads "$threads" --steps "$steps")
  row "mlp 4x1024, batch 256" "$threads" "$mp" "$pt"
done
gpt=(--model gpt --layers 4 --d-model 128 --heads 4 --seq-len 64 --vocab 256 --batch-size 16 --micro-batches 4)
threads=$(nproc)
export OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads
mp=$(mpipe_median --config inputs/quickstart.toml --threads "$threads")
pt=$(/usr/bin/python3 scripts/bench_cpu.py "${gpt[@]}" --threads "$threads" --steps "$steps")
row "gpt quickstart (4x128, 16x64 tok)" "$threads" "$mp" "$pt"
