#!/usr/bin/env bash
# scripts/torch_gpu_bench.py --micro-batches (gpu_check.sh 4c's PyTorch side), on the CPU:
# for the GPT, the batch as 4 pieces with gradients accumulated is the same step as the
# whole batch (loss and gradient norm of the last of 3 steps equal to 1e-3: only bf16
# autocast's rounding differs; a missing loss / M would give 4x the norm); a ResNet (whose
# BatchNorm sees each piece's statistics, as mpipe's micro-batches do) runs in pieces too;
# a count that does not divide the batch is refused, exit 2.
set -u
bench=$1
py=/usr/bin/python3
fail() { printf 'FAIL: %s\n%s\n' "$1" "${2:-}"; exit 1; }
gpt=(gpt --device cpu --layers 2 --d-model 64 --heads 2 --seq-len 32 --vocab 128 --batch-size 8 --warmup 2 --steps 1)
one=$($py "$bench" "${gpt[@]}" 2>&1 | tail -1)
four=$($py "$bench" "${gpt[@]}" --micro-batches 4 2>&1 | tail -1)
resnet=$($py "$bench" resnet --device cpu --layers 18 --image 16 --width 8 --classes 10 --batch-size 8 --micro-batches 4 \
         --warmup 1 --steps 1 2>&1 | tail -1)
$py - "$one" "$four" "$resnet" <<'PY' || fail "the accumulated steps" "$one
$four
$resnet"
import json, math, sys
a, b, r = (json.loads(s) for s in sys.argv[1:4])
assert a["micro_batches"] == 1 and b["micro_batches"] == 4, (a, b)
for key in ("last_loss", "last_grad_norm"):
    rel = abs(a[key] - b[key]) / abs(a[key])
    print(f"gpt {key}: M = 1 {a[key]:.6f}, M = 4 {b[key]:.6f} (relative {rel:.1e})")
    assert rel < 1e-3, key
assert r["micro_batches"] == 4 and math.isfinite(r["last_loss"]) and "error" not in r, r
print(f"resnet in 4 pieces: loss {r['last_loss']:.4f}")
PY
out=$($py "$bench" gpt --device cpu --layers 1 --d-model 32 --heads 2 --seq-len 8 --vocab 16 --batch-size 8 --micro-batches 3 2>&1)
rc=$?
[[ $rc -eq 2 && $out == *"does not divide the batch of 8"* ]] || fail "--micro-batches 3 of 8: exit $rc" "$out"
echo ok
