#!/usr/bin/env bash
# mpipe against PyTorch (Debian's python3-torch, oneDNN) on this machine: the median
# training-step time and the peak activation memory of the same model, with the same
# threads, micro-batches, AdamW and clipping. Prints one table; ratios are mpipe / PyTorch.
#   STEPS=N   steps per measurement (default 30; the first 3 are excluded)
#   LLAMA_STEPS=N  the same for the llama row (default 8: a step takes seconds there)
#   ROUNDS=N  measurements of each row, alternating mpipe and PyTorch (default 1); the
#             median step of each side over its rounds is reported
#   THREADS="1 2"  thread counts (default: 1 and 2)
#   ROWS=REGEX  only the rows whose model name matches (e.g. ROWS=resnet, ROWS=llama)
#   BASELINE=PATH  an older mpipe binary: its step time and memory in the same rounds, and
#             this build's as a ratio of them
# Memory: mpipe's own "peak activation memory" line (what its arenas hold at once at most: what a
# step keeps for backward, plus its scratch); PyTorch's, the most its C heap grew during
# one step (scripts/heap_peak.c, preloaded, counts every malloc), i.e. the step's
# activations and temporaries above the parameters, gradients and optimizer state.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
[[ -f build/release/CMakeCache.txt ]] || cmake --preset release >/dev/null
cmake --build --preset release --target mpipe >/dev/null
steps=${STEPS:-30}
rounds=${ROUNDS:-1}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
gcc -O2 -shared -fPIC scripts/heap_peak.c -o "$tmp/heap_peak.so"

# mpipe ARGS...: "median_step_s peak_bytes" of an mpipe run, from its metrics file (first
# 3 steps excluded; the summary record's peak activation bytes).
mpipe_run() {
  "${MPIPE:-build/release/mpipe}" train --steps "$steps" --log-every 1000000 --weight-decay 0.01 --metrics "$tmp/m.jsonl" "$@" > /dev/null
  /usr/bin/python3 - "$tmp/m.jsonl" <<'PY'
import json, statistics, sys
records = [json.loads(line) for line in open(sys.argv[1])]
t = [r["step_time_s"] for r in records if "step" in r][3:]
peak = max(next(r for r in records if "peak_activation_bytes_per_rank" in r)["peak_activation_bytes_per_rank"])
print(f"{statistics.median(t):.6f} {peak:.0f}")
PY
}
# PyTorch's GEMMs go through the same OpenBLAS: its kernels are set to those mpipe runs
# (mpipe may have chosen them over the library's own choice; blas_core.hpp).
blas_core=$(build/release/mpipe train --model mlp --layers 1 --hidden 8 --inputs 8 --batch-size 8 --steps 1 2>&1 |
  sed -n 's/.*BLAS OpenBLAS [^,]*, \([A-Za-z0-9]*\) kernels.*/\1/p')
torch_run() {
  OPENBLAS_CORETYPE=$blas_core LD_PRELOAD="$tmp/heap_peak.so" /usr/bin/python3 scripts/bench_cpu.py --steps "$steps" --memory "$@"
}

echo "OpenBLAS kernels: $blas_core (mpipe and PyTorch)"
printf '%-40s %7s %10s %10s %7s %11s %11s %7s' model threads "mpipe ms" "torch ms" ratio "mpipe MiB" "torch MiB" ratio
[[ -z ${BASELINE:-} ]] && echo || printf ' %10s %7s %10s %7s\n' "base ms" "/ base" "base MiB" "/ base"
# row NAME THREADS MPIPE_ARGS... -- TORCH_ARGS...: ROUNDS alternating runs of each side.
row() {
  local name=$1 threads=$2
  shift 2
  [[ -z ${ROWS:-} || $name =~ $ROWS ]] || return 0
  local mp=() pt=() seen=0
  for a in "$@"; do
    if [[ $a == -- ]]; then seen=1; elif ((seen)); then pt+=("$a"); else mp+=("$a"); fi
  done
  export OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads
  : > "$tmp/rounds"
  for _ in $(seq "$rounds"); do
    local base=""
    [[ -z ${BASELINE:-} ]] || base=$(MPIPE=$BASELINE mpipe_run "${mp[@]}" --threads "$threads")
    echo "$(mpipe_run "${mp[@]}" --threads "$threads") $(torch_run "${pt[@]}" --threads "$threads") $base" >> "$tmp/rounds"
  done
  /usr/bin/python3 - "$name" "$threads" "$tmp/rounds" <<'PY'
import statistics, sys
rows = [list(map(float, line.split())) for line in open(sys.argv[3])]
med = [statistics.median(r[i] for r in rows) for i in range(len(rows[0]))]
mp_s, mp_b, pt_s, pt_b = med[0], max(r[1] for r in rows), med[2], max(r[3] for r in rows)
line = "%-40s %7s %10.1f %10.1f %7.3f %11.1f %11.1f %7.3f" % (sys.argv[1], sys.argv[2], mp_s * 1e3, pt_s * 1e3, mp_s / pt_s,
       mp_b / 2**20, pt_b / 2**20, mp_b / pt_b)
if len(med) > 4:  # the baseline's: the ratios are this build's over it
    base_s, base_b = med[4], max(r[5] for r in rows)
    line += " %10.1f %7.3f %10.1f %7.3f" % (base_s * 1e3, mp_s / base_s, base_b / 2**20, mp_b / base_b)
print(line)
PY
}

build/release/mpipe plan --model resnet --layers 18 --image 64 --width 16 --print-model > "$tmp/resnet18.toml"
mlp=(--model mlp --layers 4 --hidden 1024 --inputs 1024 --classes 16 --batch-size 256 --micro-batches 1)
gpt=(--model gpt --layers 4 --d-model 128 --heads 4 --seq-len 64 --vocab 256 --batch-size 16 --micro-batches 4)
# A small Llama of real proportions (57M parameters, most in the 32000-token table and its
# untied head): a batch of 4 x 256 tokens takes seconds a step on one core.
llama=(--model llama --layers 8 --d-model 512 --heads 8 --kv-heads 2 --ffn 1536 --seq-len 256 --vocab 32000
       --batch-size 4 --micro-batches 2)
resnet=(--model inputs/resnet-small.toml --batch-size 64 --micro-batches 1)
cnn=(--model inputs/cnn.toml --batch-size 32 --micro-batches 4)
resnet18=(--model "$tmp/resnet18.toml" --batch-size 32 --micro-batches 1)
for threads in ${THREADS:-1 2}; do
  row "mlp 4x1024, batch 256" "$threads" "${mlp[@]}" -- "${mlp[@]}"
  # PyTorch runs each micro-batch's backward after its forward: 1F1B's order on one rank.
  row "gpt quickstart (4x128, 16x64 tok, M 4)" "$threads" "${gpt[@]}" --schedule 1f1b -- "${gpt[@]}"
  steps=${LLAMA_STEPS:-8} row "llama 8x512 kv2, 4x256 tok, V 32k, M 2" "$threads" "${llama[@]}" --schedule 1f1b -- "${llama[@]}"
  row "resnet-small (97k), 32x32, batch 64" "$threads" "${resnet[@]}" -- "${resnet[@]}"
  row "inputs/cnn.toml, 32x32, batch 32, M 4" "$threads" "${cnn[@]}" -- "${cnn[@]}"
  row "resnet-18 width 16, 64x64, batch 32" "$threads" "${resnet18[@]}" -- "${resnet18[@]}"
done
