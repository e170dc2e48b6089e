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
