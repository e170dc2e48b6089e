#!/usr/bin/env bash
# Token shards as data: peak resident memory and step time of a small GPT trained on a
# 2 GiB directory of llm.c shards (uint16, random ids below the vocabulary) against the
# same run on one tiny shard, with --data-packing windows and documents. Prints a table;
# the 2 GiB directory is deleted at the end (and on any exit).
# Usage: scripts/bench_shards.sh [MPIPE]   (default build/cpu/mpipe)
# Environment: MIB=2048 corpus size   SHARDS=8 files   STEPS=200   RANKS=2   WORK=dir for the corpus (default /tmp)
set -euo pipefail
mpipe=$(realpath "${1:-build/cpu/mpipe}")
mib=${MIB:-2048} shards=${SHARDS:-8} steps=${STEPS:-200} ranks=${RANKS:-2}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
work=$(mktemp -d "${WORK:-/tmp}/bench_shards.XXXXXX")
trap 'rm -rf "$work"' EXIT
vocab=512 eot=511
need_kib=$(( (mib + 1024) * 1024 ))
free_kib=$(df -Pk "$work" | awk 'NR == 2 {print $4}')
(( free_kib > need_kib )) || { echo "bench_shards: $work has $((free_kib / 1024)) MiB free, needs $((need_kib / 1024))"; exit 1; }
df -h "$work" | tail -1 | awk '{print "disk before: " $4 " free on " $6}'

# llm.c GPT-2 shards (magic 20240520, version 1, uint16), ids uniform below the vocabulary
# (the end-of-text id, the last, every 512 tokens on average: ~2 M documents in 2 GiB).
/usr/bin/python3 - "$work" "$mib" "$shards" "$vocab" <<'PY'
import os, sys, numpy as np
work, mib, shards, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = np.random.default_rng(1)
def shard(path, n):
    header = np.zeros(256, dtype="<i4"); header[:3] = (20240520, 1, n)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        for start in range(0, n, 1 << 26):
            f.write(rng.integers(0, vocab, min(1 << 26, n - start), dtype="<u2").tobytes())
per = mib * (1 << 20) // 2 // shards
os.makedirs(f"{work}/big"); os.makedirs(f"{work}/tiny")
for i in range(shards): shard(f"{work}/big/train_{i:03d}.bin", per)
shard(f"{work}/tiny/train_000.bin", 100_000)
PY
echo "corpus: $(du -sh "$work/big" | cut -f1) in $shards shards; tiny: $(du -sh "$work/tiny" | cut -f1)"

gpt=(train --model gpt --layers 2 --d-model 64 --heads 4 --seq-len 64 --vocab $vocab --batch-size 32 --micro-batches 4
     --threads 1 --steps "$steps" --log-every 1000 --progress off --eot-id $eot)
printf '\n%-6s %-10s %12s %12s %12s %12s %10s %8s\n' data packing "tokens" "rank0 MiB" "rank1 MiB" "+MiB/rank" "step ms" "wall s"
base=0
for row in "tiny windows" "big windows" "tiny documents" "big documents"; do
  read -r data packing <<<"$row"
  rss=$work/rss.$data.$packing
  start=$(date +%s.%N)
  mpiexec -n "$ranks" --oversubscribe bash -c '/usr/bin/time -f %M -o "$0.$OMPI_COMM_WORLD_RANK" "$@"' "$rss" \
    "$mpipe" "${gpt[@]}" --data "tokens:$work/$data" --data-packing "$packing" --summary "$work/summary.json" > "$work/log" 2>&1 \
    || { echo "run failed:"; tail -5 "$work/log"; exit 1; }
  wall=$(echo "$(date +%s.%N) - $start" | bc)
  tokens=$(grep -oE "[0-9]+ tokens" "$work/log" | head -1 | cut -d' ' -f1)
  r0=$(( $(cat "$rss.0") / 1024 )) r1=$(( $(cat "$rss.1" 2>/dev/null || echo 0) / 1024 ))
  step_ms=$(/usr/bin/python3 -c "import json,sys; print('%.1f' % (1000 * json.load(open(sys.argv[1]))['step_time_s']))" "$work/summary.json")
  [[ $data == tiny ]] && base=$(( r0 > r1 ? r0 : r1 ))
  worst=$(( r0 > r1 ? r0 : r1 ))
  printf '%-6s %-10s %12s %12s %12s %12s %10s %8.1f\n' "$data" "$packing" "$tokens" "$r0" "$r1" "$((worst - base))" "$step_ms" "$wall"
done
echo
echo "peak resident = /usr/bin/time's maximum resident set (VmHWM) of each rank's process; +MiB/rank: the larger rank's"
echo "peak less the tiny run's of the same packing; step ms: the summary's median step; wall: the whole mpiexec (start-up"
echo "included: documents packing reads every shard once at opening, twice per rank: the start-up check and the run)"
rm -rf "$work/big"
df -h "$work" | tail -1 | awk '{print "disk after: " $4 " free on " $6}'
