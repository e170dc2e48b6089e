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

# The stall: what a checkpoint costs the step loop, synchronous and --checkpoint-async on,
# against a run with no periodic checkpoint, rounds ordered A B C C B A: 12 steps of the
# same model with a checkpoint after step 6, each log line timed as it arrives. The
# stall is the time from step 6's line to step 12's over the no-checkpoint run's (the
# final checkpoint, written at once in every variant, comes after). STALL_RANKS=1 runs it
# on one rank, leaving this VM's second core to the background write.
stall_ranks=${STALL_RANKS:-2}
stall=(--model gpt --layers 12 --d-model 768 --heads 12 --seq-len 64 --vocab 50257 --batch-size 2 --micro-batches 2
       --threads 1 --steps 12 --log-every 1 --progress off)
declare -A window=([none]=0 [sync]=0 [async]=0)
waited=() background=()
variant() {  # NAME: one run; adds half its step 6 -> 12 time to window[NAME]
  local args=()
  case $1 in sync) args=(--checkpoint-every 6) ;; async) args=(--checkpoint-every 6 --checkpoint-async on) ;; esac
  rm -rf "$dir/stall"
  mpirun -n "$stall_ranks" --bind-to core build/release/mpipe train "${stall[@]}" --checkpoint-dir "$dir/stall" "${args[@]}" |
    while IFS= read -r line; do printf '%s %s\n' "$(date +%s.%N)" "$line"; done > "$dir/stall.log"
  local t
  t=$(awk '$2 == "step" && $3 == "6/12" { a = $1 } $2 == "step" && $3 == "12/12" { b = $1 } END { print b - a }' "$dir/stall.log")
  window[$1]=$(awk -v w="${window[$1]}" -v t="$t" 'BEGIN { print w + t / 2 }')
  if [[ $1 == async ]]; then
    waited+=($(sed -n 's/.*training waited \([0-9.]*\) s.*/\1/p' "$dir/stall.log"))
    background+=($(sed -n 's/.*written in the background: .* in \([0-9.]*\) s .*verified in \([0-9.]*\) s/\1+\2/p' "$dir/stall.log"))
  fi
  return 0
}
for v in none sync async async sync none; do variant "$v"; done
write_s=$(sed -n 's/.*written: .* in \([0-9.]*\) s .*/\1/p' <<<"$write_log")
/usr/bin/python3 - "${window[none]}" "${window[sync]}" "${window[async]}" "$write_s" "${waited[*]}" "${background[*]}" "$stall_ranks" <<'PY'
import sys
none, sync, asynchronous, write_s = map(float, sys.argv[1:5])
waited = [float(w) for w in sys.argv[5].split()]
background = [eval(b) for b in sys.argv[6].split()]
print()
print(f"the step loop's stall for a checkpoint after step 6 of 12 on {sys.argv[7]} rank(s) (steps 6 -> 12; mean of 2 runs"
      " each, A B C C B A)")
print(f"{'':28} {'steps 6-12 s':>13} {'stall s':>8} {'/ sync write':>13}")
print(f"{'no periodic checkpoint':28} {none:13.2f}")
for name, window in (("synchronous", sync), ("--checkpoint-async on", asynchronous)):
    stall = window - none
    print(f"{name:28} {window:13.2f} {stall:8.2f} {stall / write_s:12.2f}x")
if waited:
    print(f"--checkpoint-async: training waited {min(waited):.3f}-{max(waited):.3f} s at the checkpoint (the copy); "
          f"the background write and verification took {min(background):.2f}-{max(background):.2f} s")
print(f"(the synchronous write above: {write_s:.2f} s; the target: a stall of at most 0.1x it)")
PY
