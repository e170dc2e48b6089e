#!/usr/bin/env bash
# Checkpoint throughput: a GPT-2-small-sized model (124M parameters; the file holds
# parameters and AdamW's two moments, ~1.5 GB) written with K = 2 ranks in parallel and
# read back on resume, beside `dd` writing and reading the same bytes on the same disk.
#   CKPT_DIR=DIR   where to write (default build/bench-checkpoint, the repository's disk)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
[[ -f build/release/CMakeCache.txt ]] || cmake --preset release >/dev/null
cmake --build --preset release --target mpipe >/dev/null
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
dir=${CKPT_DIR:-build/bench-checkpoint}
rm -rf "$dir"; mkdir -p "$dir"
trap 'rm -rf "$dir"' EXIT
model=(--model gpt --layers 12 --d-model 768 --heads 12 --seq-len 64 --vocab 50257 --batch-size 2
       --micro-batches 2 --steps 1 --threads 1 --checkpoint-dir "$dir")

write_log=$(mpirun -n 2 --bind-to core build/release/mpipe train "${model[@]}")
file=$(ls "$dir"/ckpt-*.h5)
# The checkpoint was written past the page cache; drop any cached pages of it anyway
# so that resume reads from the disk, as after a requeue on another node.
/usr/bin/python3 -c "import os,sys; fd=os.open(sys.argv[1], os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)" "$file"
read_log=$(mpirun -n 2 --bind-to core build/release/mpipe train "${model[@]}" --resume auto)
bytes=$(stat -c %s "$file")
count=$(( (bytes + 16777215) / 16777216 ))
dd_write=$(dd if=/dev/zero of="$dir/dd.bin" bs=16M count="$count" conv=fsync 2>&1 | tail -1)
# Reading: the checkpoint file itself, from the disk (direct I/O), as resume reads it cold.
dd_read=$(dd if="$file" of=/dev/null bs=16M iflag=direct 2>&1 | tail -1)
# A plain buffered write of the same bytes from (cold) memory, as a program writes its
# own data: what the page cache allows, whatever the file format.
plain=$(/usr/bin/python3 - "$dir/plain.bin" "$bytes" <<'PY'
import os, sys, time
import numpy as np
data = np.ones(int(sys.argv[2]) // 4, np.float32)
start = time.time()
with open(sys.argv[1], "wb") as f:
    data.tofile(f); f.flush(); os.fsync(f.fileno())
print(data.nbytes / (time.time() - start) / 1e6)
PY
)

/usr/bin/python3 - "$bytes" "$write_log" "$read_log" "$dd_write" "$dd_read" "$plain" <<'PY'
import re, sys
size = int(sys.argv[1])
w = re.search(r"written: .* in ([0-9.]+) s .*verified in ([0-9.]+) s", sys.argv[2])
r = re.search(r"checked and loaded in ([0-9.]+) s", sys.argv[3])
def dd_rate(line):  # "N bytes (...) copied, T s, R MB/s"
    b, t = re.search(r"^(\d+) bytes.* copied, ([0-9.]+) s", line).groups()
    return int(b) / float(t) / 1e6
write_s, verify_s, read_s = float(w.group(1)), float(w.group(2)), float(r.group(1))
mp_w, mp_r = size / write_s / 1e6, size / read_s / 1e6
dw, dr = dd_rate(sys.argv[4]), dd_rate(sys.argv[5])
print(f"checkpoint of 124M parameters + AdamW state: {size / 1e9:.2f} GB, K = 2 writers")
print(f"{'':34} {'MB/s':>9} {'dd MB/s':>9} {'ratio':>7}   (dd: write conv=fsync; read iflag=direct)")
print(f"{'write (write + close + fsync)':34} {mp_w:9.0f} {dw:9.0f} {mp_w / dw:7.2f}")
print(f"{'resume (check + load, from disk)':34} {mp_r:9.0f} {dr:9.0f} {mp_r / dr:7.2f}")
plain = float(sys.argv[6])
print(f"{'plain write from memory (numpy)':34} {plain:9.0f} {dw:9.0f} {plain / dw:7.2f}")
print(f"mpipe write / plain write: {mp_w / plain:.2f}")
print(f"verify after writing (re-read every checksum, rename): {verify_s:.2f} s")
PY

# The stall: what a checkpoint costs the step loop, synchronous (--checkpoint-async off: the
# default, auto, writes in the background where MPI allows) and --checkpoint-async on,
# against a run with no periodic checkpoint, rounds ordered A B C C B A (ROUNDS=2 such
# sequences): 12 steps of the same model with a checkpoint after step 6, each log line
# timed as it arrives. The checkpoint (and with --checkpoint-async the next update's wait
# for the copy) falls between step 6's line and step 7's: the stall is that interval over
# the no-checkpoint runs' (the issue's measure: the step that checkpoints against a normal
# step), and the whole of steps 6 -> 12 over theirs (a background write's cost to the
# steps after it; the final checkpoint, written at once in every variant, comes after).
# STALL_RANKS=1 runs it on one rank, leaving this VM's second core to the background write.
stall_ranks=${STALL_RANKS:-2} stall_rounds=${ROUNDS:-2}
stall=(--model gpt --layers 12 --d-model 768 --heads 12 --seq-len 64 --vocab 50257 --batch-size 2 --micro-batches 2
       --threads 1 --steps 12 --log-every 1 --progress off)
variant() {  # NAME: one run; its step times (6 -> 7 and 6 -> 12) and its background lines into $dir/stall.NAME
  local args=()
  case $1 in sync) args=(--checkpoint-every 6 --checkpoint-async off) ;; async) args=(--checkpoint-every 6 --checkpoint-async on) ;; esac
  rm -rf "$dir/stall"
  mpirun -n "$stall_ranks" --bind-to core build/release/mpipe train "${stall[@]}" --checkpoint-dir "$dir/stall" "${args[@]}" |
    while IFS= read -r line; do printf '%s %s\n' "$(date +%s.%N)" "$line"; done > "$dir/stall.log"
  awk '$2 == "step" && $3 == "6/12" { a = $1 } $2 == "step" && $3 == "7/12" { b = $1 } $2 == "step" && $3 == "12/12" { c = $1 }
       /training waited/ { w = $0; sub(/.*training waited /, "", w); sub(/ s.*/, "", w) }
       /written in the background/ { u = $0; sub(/.*the next update waited /, "", u); sub(/ s.*/, "", u)
                                     g = $0; sub(/.*B in /, "", g); sub(/ s .*/, "", g)
                                     v = $0; sub(/.*verified in /, "", v); sub(/ s.*/, "", v) }
       END { printf "%s %.6f %.6f %s %s %s\n", name, b - a, c - a, w ? w : "-", u ? u : "-", (g ? g + v : "-") }' \
    name="$1" "$dir/stall.log" >> "$dir/stall.times"
}
rm -f "$dir/stall.times"
for ((r = 0; r < stall_rounds; ++r)); do
  for v in none sync async async sync none; do variant "$v"; done
done
write_s=$(sed -n 's/.*written: .* in \([0-9.]*\) s .*/\1/p' <<<"$write_log")
/usr/bin/python3 - "$dir/stall.times" "$write_s" "$stall_ranks" "$stall_rounds" <<'PY'
import statistics, sys
rows = [line.split() for line in open(sys.argv[1])]
write_s, ranks, rounds = float(sys.argv[2]), sys.argv[3], int(sys.argv[4])
def of(name, col):
    return [float(r[col]) for r in rows if r[0] == name and r[col] != "-"]
print()
print(f"the step loop's stall for a checkpoint after step 6 of 12 on {ranks} rank(s), means of {2 * rounds} runs each"
      f" (A B C C B A x {rounds})")
print(f"{'':24} {'step 6->7 s':>12} {'stall s':>8} {'/ sync write':>13} {'steps 6->12 s':>14} {'stall s':>8} {'/ sync write':>13}")
none7, none12 = statistics.mean(of("none", 1)), statistics.mean(of("none", 2))
print(f"{'no periodic checkpoint':24} {none7:12.3f} {'':8} {'':13} {none12:14.2f}")
for name, label in (("sync", "synchronous"), ("async", "--checkpoint-async on")):
    a7, a12 = statistics.mean(of(name, 1)), statistics.mean(of(name, 2))
    print(f"{label:24} {a7:12.3f} {a7 - none7:8.3f} {(a7 - none7) / write_s:12.2f}x {a12:14.2f} {a12 - none12:8.2f} {(a12 - none12) / write_s:12.2f}x")
waited, copy, background = of("async", 3), of("async", 4), of("async", 5)
if waited:
    print(f"--checkpoint-async: training waited {min(waited):.3f}-{max(waited):.3f} s at the checkpoint (rendezvous, running"
          f" statistics), {min(copy):.3f}-{max(copy):.3f} s at the next update for the copy (rank 0); the background copy,"
          f" write and verification took {min(background):.2f}-{max(background):.2f} s")
print(f"(the synchronous write above: {write_s:.2f} s; the target: a stall of at most 0.1x it)")
PY
