#!/usr/bin/env bash
# GPU throughput of mpipe's CUDA backend: this GPU's measured bf16 GEMM rate, then each
# op of a GPT-2-medium-sized block (B 8, T 1024, C 1024, 16 heads) in bf16 as TFLOP/s and
# as a fraction of that rate (GB/s for the memory-bound ops), then a whole training step
# of a 24-block GPT-2-medium-sized model (bf16, AdamW) as model FLOPs utilisation (MFU).
# Target on an H200: MFU of at least 45%. Then the same model as a 2-stage pipeline on
# one GPU per stage when the node has two GPUs.
#   ARGS="--batch 8 --micro-batches 4 ..." are passed to the benchmark program.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
[[ -f build/release/CMakeCache.txt ]] || cmake --preset release >/dev/null
cmake --build --preset release --target bench_gpu mpipe >/dev/null
[[ -x build/release/tests/bench_gpu ]] || { echo "bench_gpu.sh: this build has no CUDA backend (no nvcc at configure time)" >&2; exit 1; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
rc=0
# shellcheck disable=SC2086
build/release/tests/bench_gpu ${ARGS:-} || rc=$?
if [[ $rc -eq 77 ]]; then echo "bench_gpu.sh: no GPU here; nothing to measure"; exit 0; fi
[[ $rc -eq 0 ]] || exit $rc

gpus=$(nvidia-smi -L 2>/dev/null | wc -l || echo 0)
if [[ $gpus -ge 2 ]]; then
  echo
  echo "2-stage pipeline, one GPU per stage, bf16, M=8 (throughput from the run's summary):"
  mpirun -n 2 build/release/mpipe train --device cuda --precision bf16 --layers 24 --d-model 1024 --heads 16 \
    --seq-len 1024 --vocab 50257 --batch-size 64 --micro-batches 8 --steps 8 --log-every 4 --lr 1e-4 | tail -12
fi
