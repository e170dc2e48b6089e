#!/usr/bin/env bash
# train --cuda-graphs on from a cold start, as a user runs it: two ranks on the GPU, the
# quickstart GPT in bf16. It must end with exit 0, its losses must be the bits of the same
# run with graphs off, and each rank must say it launched graphs, made each once (step 3)
# and updated them in place after (steps 4-8). Exit 77 (skipped) without a GPU.
# Usage: graphs_cli.sh MPIEXEC MPIPE CONFIG
set -u
mpiexec=$1 mpipe=$2 config=$3
nvidia-smi -L > /dev/null 2>&1 || { echo "SKIPPED: no GPU (nvidia-smi -L failed)"; exit 77; }
run() {
  timeout 300 "$mpiexec" -n 2 --oversubscribe "$mpipe" train --config "$config" --device cuda --precision bf16 --steps 8 \
    --threads 1 --log-every 1 --resume never "$@" 2>&1
}
on=$(run --cuda-graphs on) || { printf 'FAIL: --cuda-graphs on exited %s\n%s\n' "$?" "$on"; exit 1; }
off=$(run --cuda-graphs off) || { printf 'FAIL: --cuda-graphs off exited %s\n%s\n' "$?" "$off"; exit 1; }
losses() { grep -Eo 'loss [0-9.]+ .*grad norm +[0-9.]+' <<<"$1"; }
[[ -n $(losses "$on") && $(losses "$on") == $(losses "$off") ]] ||
  { printf 'FAIL: losses differ\n--- on:\n%s\n--- off:\n%s\n' "$(losses "$on")" "$(losses "$off")"; exit 1; }
line=$(grep -m1 '^CUDA graphs per rank' <<<"$on") || { printf 'FAIL: no graph counts\n%s\n' "$on"; exit 1; }
echo "$line"
# " L (M, U; N)" per rank: launched, made, updated, nodes a graph. Six graphed steps.
/usr/bin/env python3 - "$line" <<'PY' || exit 1
import re, sys
ranks = re.findall(r" (\d+) \((\d+), (\d+); (\d+)\)", sys.argv[1])
ok = len(ranks) == 2
for launched, made, updated, nodes in ([int(v) for v in r] for r in ranks):
    ok = ok and launched > 0 and made * 6 == launched and updated == launched - made and nodes > 0
print("ok" if ok else f"FAIL: counts {ranks}: want launched > 0, made = launched / 6, updated = the rest, nodes > 0")
sys.exit(0 if ok else 1)
PY
