#!/usr/bin/env bash
# Checkpoint tests with the real binary under mpiexec and real HDF5 files.
# Usage: checkpoint_test.sh MPIPE CASE   (CASE: layout | resume | reshard | preempt |
#        damaged | bad-input | keep | continue | ownership | lock | state | stopped | model-file | eval | image-data |
#        slow-term | hostile | data-changed | async)
set -euo pipefail
mpipe=$1 case=$2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
work=$(mktemp -d)
# On any exit: the jobs this script left in the background (a failed check mid-trial) go first.
# The clean-up keeps the script's status: a job already gone (kill fails) must not turn a pass
# into exit 1 under set -e.
trap 'rc=$?; set +e; for j in $(jobs -p); do pkill -9 -P "$j"; kill -9 "$j"; done 2>/dev/null; chattr -i "$work"/* 2>/dev/null; rm -rf "$work"; exit $rc' EXIT
model=(train --model gpt --layers 3 --d-model 32 --heads 4 --seq-len 16 --vocab 64 --dropout 0.1
       --batch-size 8 --micro-batches 4 --threads 1 --lr 3e-3 --log-every 1)
run() { local n=$1; shift; mpiexec -n "$n" --oversubscribe "$mpipe" "$@"; }
fail() { echo "FAIL: $*"; exit 1; }
losses() {  # the per-step losses of a metrics file (its last line, the summary, has none)
  local out
  out=$(/usr/bin/python3 -c "import json,sys; print(' '.join(str(r['loss']) for r in map(json.loads, open(sys.argv[1])) if 'loss' in r))" "$1") \
    || fail "cannot read losses from $1"
  [[ -n "$out" ]] || fail "no losses in $1"
  echo "$out"
}
same_tensors() {  # two checkpoints' /model and /optimizer, compared by h5diff
  h5diff "$1" "$2" /model /model || fail "/model of $1 and $2 differ"
  h5diff "$1" "$2" /optimizer /optimizer || fail "/optimizer of $1 and $2 differ"
}
expect_error() {  # CODE REGEX command...: exit code and one error line matching REGEX
  local code=$1 regex=$2; shift 2
  set +e; out=$("$@" 2>&1); rc=$?; set -e
  [[ $rc -eq $code ]] || fail "expected exit $code, got $rc: $out"
  grep -Eq -- "$regex" <<<"$out" || fail "output does not match /$regex/: $out"
  [[ $(grep -c 'error' <<<"$out") -eq 1 ]] || fail "expected one error line: $out"
}

case $case in
layout)
  # The same run with K = 1 and K = 4 writes identical /model and /optimizer.
  mkdir "$work/k1" "$work/k4"
  run 1 "${model[@]}" --steps 4 --checkpoint-dir "$work/k1" >/dev/null
  run 4 "${model[@]}" --steps 4 --checkpoint-dir "$work/k4" --schedule 1f1b --remat always >/dev/null
  same_tensors "$work/k1/ckpt-00000004.h5" "$work/k4/ckpt-00000004.h5"
  # A schedule from a file (stage 0 as GPipe, stage 1 between with its backwards split
  # into B and W, stage 2 as 1F1B): the same tensors.
  printf '%s\n' "stage 0: F0 F1 F2 F3 B0 B1 B2 B3" "stage 1: F0 F1 B0 F2 B1 W0 F3 W1 B2 W2 B3 W3" \
    "stage 2: F0 B0 F1 B1 F2 B2 F3 B3" \
    > "$work/mixed.txt"
  mkdir "$work/file"
  run 3 "${model[@]}" --steps 4 --checkpoint-dir "$work/file" --schedule "file:$work/mixed.txt" --remat except-last >/dev/null
  same_tensors "$work/k1/ckpt-00000004.h5" "$work/file/ckpt-00000004.h5"
  # Interleaved, 2 ranks x 3 model stages each (stages 0, 2, 4 on rank 0): written by the
  # ranks holding each layer, the same tensors.
  mkdir "$work/interleaved"
  run 2 "${model[@]}" --steps 4 --checkpoint-dir "$work/interleaved" --schedule interleaved --virtual-stages 3 >/dev/null
  same_tensors "$work/k1/ckpt-00000004.h5" "$work/interleaved/ckpt-00000004.h5"
  # Data written through HDF5's MPI-IO driver instead of O_DIRECT: the same file content.
  mkdir "$work/buffered"
  MPIPE_CHECKPOINT_BUFFERED=1 mpiexec -n 2 -x MPIPE_CHECKPOINT_BUFFERED --oversubscribe "$mpipe" "${model[@]}" --steps 4 \
    --checkpoint-dir "$work/buffered" >/dev/null
  same_tensors "$work/k1/ckpt-00000004.h5" "$work/buffered/ckpt-00000004.h5"
  "$mpipe" inspect "$work/k4/ckpt-00000004.h5" --verify --stats > "$work/inspect.txt"
  grep "verify: every checksum matches" "$work/inspect.txt" >/dev/null || fail "inspect: $(cat "$work/inspect.txt")"
  h5ls -r "$work/k4/ckpt-00000004.h5" | grep "/model/0000/wte .*Dataset {64, 32}" >/dev/null || fail "h5ls does not show /model/0000/wte"
  /usr/bin/python3 "$(dirname "$0")/../../scripts/inspect_checkpoint.py" "$work/k4/ckpt-00000004.h5" > "$work/py.txt"
  grep "crc ok" "$work/py.txt" >/dev/null && ! grep "crc BAD" "$work/py.txt" || fail "inspect_checkpoint.py: $(cat "$work/py.txt")"
  ;;
resume)
  # Stopped after step 3 and resumed (same K): the same losses, an identical final
  # checkpoint. The "stop" is the step-3 checkpoint of the unbroken run, copied away.
  mkdir "$work/full" "$work/part"
  run 2 "${model[@]}" --steps 6 --checkpoint-dir "$work/full" --checkpoint-every 3 --metrics "$work/full.jsonl" >/dev/null
  cp "$work/full/ckpt-00000003.h5" "$work/part/"
  out=$(run 2 "${model[@]}" --steps 6 --checkpoint-dir "$work/part" --metrics "$work/b.jsonl")
  grep "resumed from .*ckpt-00000003.h5" <<<"$out" >/dev/null || fail "did not resume: $out"
  [[ "$(losses "$work/full.jsonl" | cut -d' ' -f4-)" == "$(losses "$work/b.jsonl")" ]] || fail "losses differ"
  same_tensors "$work/full/ckpt-00000006.h5" "$work/part/ckpt-00000006.h5"
  # --overlap-steps with clipping that fires on some steps (bets won and lost; a lost one
  # is in flight at a checkpoint, which must wait for it): each checkpoint holds the agreed
  # state, the same as without it, and a resumed run goes on the same.
  mkdir "$work/sync" "$work/ahead" "$work/ahead-part"
  run 2 "${model[@]}" --steps 6 --clip-grad 1.1 --checkpoint-dir "$work/sync" --checkpoint-every 2 >/dev/null
  out=$(run 2 "${model[@]}" --steps 6 --clip-grad 1.1 --overlap-steps --checkpoint-dir "$work/ahead" --checkpoint-every 2)
  grep -E "overlap-steps: [1-9][0-9]* updates made ahead of their agreement, [1-9][0-9]* undone" <<<"$out" >/dev/null ||
    fail "no update made ahead and undone: $out"
  for step in 2 4 6; do same_tensors "$work/sync/ckpt-0000000$step.h5" "$work/ahead/ckpt-0000000$step.h5"; done
  cp "$work/ahead/ckpt-00000002.h5" "$work/ahead-part/"
  run 2 "${model[@]}" --steps 6 --clip-grad 1.1 --overlap-steps --checkpoint-dir "$work/ahead-part" >/dev/null
  same_tensors "$work/sync/ckpt-00000006.h5" "$work/ahead-part/ckpt-00000006.h5"
  ;;
reshard)
  # K = 4, D = 1 -> K = 2, D = 1: training continues bitwise as the unbroken run.
  # K = 4, D = 1 -> K = 2, D = 2 (micro-batches of the same size): the same up to the
  # order in which the replicas' gradients are summed.
  mkdir "$work/k4" "$work/k2" "$work/d2"
  run 4 "${model[@]}" --steps 6 --checkpoint-dir "$work/k4" --checkpoint-every 3 --metrics "$work/k4.jsonl" >/dev/null
  cp "$work/k4/ckpt-00000003.h5" "$work/k2/"
  cp "$work/k4/ckpt-00000003.h5" "$work/d2/"
  out=$(run 2 "${model[@]}" --steps 6 --checkpoint-dir "$work/k2" --metrics "$work/k2.jsonl")
  grep "resumed from" <<<"$out" >/dev/null || fail "did not resume: $out"
  [[ "$(losses "$work/k4.jsonl" | cut -d' ' -f4-)" == "$(losses "$work/k2.jsonl")" ]] || fail "losses after K 4 -> 2 differ"
  same_tensors "$work/k4/ckpt-00000006.h5" "$work/k2/ckpt-00000006.h5"
  out=$(run 4 "${model[@]}" --steps 6 --checkpoint-dir "$work/d2" --stages 2 --replicas 2 --micro-batches 2 \
    --metrics "$work/d2.jsonl")
  grep "resumed from" <<<"$out" >/dev/null || fail "did not resume: $out"
  /usr/bin/python3 - "$(losses "$work/k4.jsonl" | cut -d' ' -f4-)" "$(losses "$work/d2.jsonl")" <<'PY' || fail "losses after K 4 -> 2 x D 2 differ"
import sys
a, b = ([float(x) for x in s.split()] for s in sys.argv[1:])
assert len(a) == len(b) == 3 and all(abs(x - y) <= 1e-5 * abs(x) for x, y in zip(a, b)), (a, b)
PY
  ;;
preempt)
  # SIGUSR1 (Slurm's --signal) mid-run: a checkpoint, exit code 75, and resuming
  # finishes exactly as an unbroken run. 200 steps of a few ms: with 40 the run could end
  # before the signal reached it, the check polling every 50 ms on a loaded machine.
  mkdir "$work/full" "$work/cut"
  run 2 "${model[@]}" --steps 200 --checkpoint-dir "$work/full" >/dev/null
  set +e
  mpiexec -n 2 --oversubscribe "$mpipe" "${model[@]}" --steps 200 --checkpoint-dir "$work/cut" --metrics "$work/m.jsonl" \
    > "$work/log" 2>&1 &
  pid=$!
  for _ in $(seq 200); do [[ -s "$work/m.jsonl" && $(wc -l < "$work/m.jsonl") -ge 3 ]] && break; sleep 0.05; done
  kill -USR1 "$pid"
  wait "$pid"; rc=$?
  set -e
  [[ $rc -eq 75 ]] || fail "preempted run exited $rc, expected 75: $(cat "$work/log")"
  grep -q "stop signal received" "$work/log" || fail "no stop message"
  ls "$work/cut"/ckpt-*.h5 >/dev/null || fail "no checkpoint after the signal"
  out=$(run 2 "${model[@]}" --steps 200 --checkpoint-dir "$work/cut")
  grep "resumed from" <<<"$out" >/dev/null || fail "did not resume: $out"
  same_tensors "$work/full/ckpt-00000200.h5" "$work/cut/ckpt-00000200.h5"
  # SIGTERM to rank 1 alone: rank 0 says why it stops (the signal reached another rank;
  # it said "--time-limit reached" with no time limit given).
  mkdir "$work/rank1"
  mpiexec -n 2 --oversubscribe "$mpipe" "${model[@]}" --steps 100000 --checkpoint-dir "$work/rank1" --metrics "$work/r.jsonl" \
    > "$work/log" 2>&1 &
  pid=$!
  for _ in $(seq 200); do [[ -s "$work/r.jsonl" && $(wc -l < "$work/r.jsonl") -ge 3 ]] && break; sleep 0.05; done
  for child in $(pgrep -P "$pid"); do
    tr '\0' '\n' < "/proc/$child/environ" | grep -qx "OMPI_COMM_WORLD_RANK=1" && kill -TERM "$child"
  done
  set +e; wait "$pid"; rc=$?; set -e
  [[ $rc -eq 75 ]] || fail "SIGTERM to rank 1: exit $rc, expected 75: $(tail -5 "$work/log")"
  grep -q "^step [0-9]*: a stop signal reached another rank; checkpointing and exiting with code 75" "$work/log" \
    || fail "SIGTERM to rank 1: $(grep -a "^step [0-9]*:" "$work/log")"
  # SIGTERM to mpirun (what timeout(1) sends): Open MPI's mpirun passes SIGTERM to the
  # ranks, stops reading their output and kills them odls_base_sigkill_timeout (1 s)
  # later, exiting 1 whatever they return. With a step log line every step the output
  # pipe fills; the ranks must still write their checkpoint and release the lock.
  mkdir "$work/term"
  mpiexec -n 2 --oversubscribe "$mpipe" "${model[@]}" --steps 100000 --checkpoint-dir "$work/term" --metrics "$work/t.jsonl" \
    > "$work/t.log" 2>&1 &
  pid=$!
  for _ in $(seq 400); do [[ -s "$work/t.jsonl" && $(wc -l < "$work/t.jsonl") -ge 200 ]] && break; sleep 0.05; done
  kill -TERM "$pid"
  set +e; wait "$pid"; set -e
  ckpt=$(ls "$work/term"/ckpt-*.h5 2>/dev/null) || fail "no checkpoint after SIGTERM to mpirun: $(ls -A "$work/term")"
  [[ ! -e "$work/term/.mpipe.lock" ]] || fail "the lock outlived the job stopped by SIGTERM"
  at=$(basename "$ckpt" .h5); at=$((10#${at#ckpt-}))
  ((at >= 200)) || fail "checkpoint at step $at"
  "$mpipe" inspect "$ckpt" --verify >/dev/null || fail "$ckpt does not verify"
  ;;
slow-term)
  # Steps longer than mpirun's 1 s between its SIGTERM and its SIGKILL: the run says so
  # (once, after its first step), and launched with the setting it names, a SIGTERM to
  # mpirun leaves a new checkpoint that verifies. (Without it the checkpoint is lost:
  # SIGKILL 1 s after the ranks' SIGTERM, mid-step.)
  slow=(train --model mlp --layers 4 --hidden 1024 --batch-size 8192 --micro-batches 2 --threads 1 --log-every 1
        --checkpoint-dir "$work/slow")
  out=$(run 2 "${slow[@]}" --steps 1 2>&1) || fail "the 1-step run failed: $out"
  step_ms=$(sed -n 's/^step .* | *\([0-9.]*\) ms | .*/\1/p' <<<"$out")
  [[ -n "$step_ms" ]] && awk -v ms="$step_ms" 'BEGIN { exit !(ms > 1000) }' || fail "the step took ${step_ms:-?} ms, not > 1 s"
  note=$(grep "^note: a SIGTERM to mpirun" <<<"$out") || fail "no note about mpirun's SIGKILL: $out"
  grace=$(sed -n "s/.*'mpirun --mca odls_base_sigkill_timeout \([0-9]*\)'.*/\1/p" <<<"$note")
  [[ -n "$grace" && $grace -ge 10 ]] || fail "the note names no usable setting: $note"
  rm -rf "$work/slow"
  mpiexec -n 2 --oversubscribe --mca odls_base_sigkill_timeout "$grace" "$mpipe" "${slow[@]}" --steps 100000 \
    > "$work/slow.log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do grep -q "^step *1/" "$work/slow.log" && break; sleep 0.05; done
  grep -q "^step *1/" "$work/slow.log" || fail "no first step: $(cat "$work/slow.log")"
  ! grep -q "^note: a SIGTERM" "$work/slow.log" || fail "the note with the setting given: $(cat "$work/slow.log")"
  kill -TERM "$pid"
  set +e; wait "$pid"; set -e
  ckpt=$(ls "$work/slow"/ckpt-*.h5 2>/dev/null) || fail "no checkpoint after SIGTERM to mpirun: $(cat "$work/slow.log")"
  "$mpipe" inspect "$ckpt" --verify >/dev/null || fail "$ckpt does not verify"
  [[ ! -e "$work/slow/.mpipe.lock" ]] || fail "the lock outlived the job"
  echo "SIGTERM to mpirun with odls_base_sigkill_timeout $grace, steps of $step_ms ms: $(basename "$ckpt") kept"
  ;;
continue)
  # A checkpoint says how to continue it: `inspect --config` writes the run's options as
  # a file that `train --config` takes as is, and the run goes on from the checkpoint.
  opts=(train --model gpt --layers 3 --d-model 32 --heads 4 --seq-len 16 --vocab 64 --batch-size 8
        --micro-batches 2 --threads 1 --lr 3e-3 --schedule 1f1b --balance 3,4 --remat except-last
        --lr-schedule wsd --wsd-decay 0.5 --dropout 0.1 --log-every 1)
  run 2 "${opts[@]}" --steps 4 --checkpoint-dir "$work/straight" >/dev/null
  run 2 "${opts[@]}" --steps 2 --lr-decay-steps 4 --checkpoint-dir "$work/cont" >/dev/null
  "$mpipe" inspect "$work/cont/ckpt-00000002.h5" --config > "$work/run.toml"
  for key in 'device = "cpu"' 'precision = "fp32"' 'balance = "3,4"' 'schedule = "1f1b"' 'remat = "except-last"' \
             'lr = 0.003' 'lr-schedule = "wsd"' "checkpoint-dir = \"$work/cont\""; do
    grep -qxF "$key" "$work/run.toml" || fail "inspect --config lacks '$key': $(cat "$work/run.toml")"
  done
  sed -i 's/^steps = 2$/steps = 4/; s/^lr-decay-steps = 4$/lr-decay-steps = 0/' "$work/run.toml"
  out=$(run 2 train --config "$work/run.toml" 2>&1) || fail "train --config from inspect --config: $out"
  grep -q "resumed from .*cont/ckpt-00000002.h5" <<<"$out" || fail "did not resume: $out"
  grep -q "partition (balance): 0-2 | 3-6" <<<"$out" || fail "not the recorded partition: $out"
  same_tensors "$work/straight/ckpt-00000004.h5" "$work/cont/ckpt-00000004.h5"
  # Two jobs of 50 steps with --lr-decay-steps 100 are one run of 100 steps, bitwise.
  run 2 "${model[@]}" --steps 100 --checkpoint-dir "$work/s100" >/dev/null
  run 2 "${model[@]}" --steps 50 --lr-decay-steps 100 --checkpoint-dir "$work/j2" >/dev/null
  run 2 "${model[@]}" --steps 100 --checkpoint-dir "$work/j2" > "$work/j2.log"
  grep -q "resumed from .*ckpt-00000050.h5" "$work/j2.log" || fail "the second job did not resume: $(cat "$work/j2.log")"
  same_tensors "$work/s100/ckpt-00000100.h5" "$work/j2/ckpt-00000100.h5"
  # --time-limit: the step in flight ends, a checkpoint is written, exit 75 well before the
  # limit; the next job goes on from there.
  set +e
  start=$(date +%s)
  out=$(run 2 "${model[@]}" --steps 1000000 --time-limit 0:04 --checkpoint-dir "$work/tl" 2>&1); rc=$?
  took=$(( $(date +%s) - start ))
  set -e
  [[ $rc -eq 75 ]] || fail "--time-limit: exit $rc, not 75: $out"
  grep -q "step [0-9]*: --time-limit reached; checkpointing and exiting with code 75" <<<"$out" || fail "no message: $out"
  ((took < 4 + 10)) || fail "--time-limit 0:04 ended after $took s"
  ckpt=$(ls "$work/tl"/ckpt-*.h5) && [[ $(wc -l <<<"$ckpt") -eq 1 ]] || fail "expected one checkpoint: $ckpt"
  at=$(basename "$ckpt" .h5); at=$((10#${at#ckpt-}))
  ((at > 0)) || fail "no step before the time limit"
  out=$(run 2 "${model[@]}" --steps $((at + 2)) --checkpoint-dir "$work/tl" 2>&1) || fail "resume after the limit: $out"
  grep -q "resumed from .*ckpt-$(printf %08d "$at").h5" <<<"$out" || fail "did not resume after the limit: $out"
  for bad in abc 1:2:3:4 -5 0 1-2:3:4:5 1e999; do
    expect_error 2 "--time-limit '$bad'" run 1 "${model[@]}" --steps 2 --time-limit "$bad"
  done
  ;;
damaged)
  # A truncated newest file is skipped with a warning; an altered one fails its
  # checksum; neither is ever loaded.
  mkdir "$work/d"
  run 1 "${model[@]}" --steps 4 --checkpoint-dir "$work/d" --checkpoint-every 1 >/dev/null
  newest="$work/d/ckpt-00000004.h5"
  cp "$work/d/ckpt-00000003.h5" "$work/altered.h5"
  /usr/bin/python3 - "$work/altered.h5" <<'PY'
import h5py, sys
with h5py.File(sys.argv[1], "r+") as f:   # change one weight, keep the old checksum
    d = f["/model/0001/mlp.c_fc.weight"]; v = d[()]; v[0, 0] += 1.0; d[...] = v
PY
  expect_error 2 "fails its checksum" "$mpipe" inspect "$work/altered.h5" --verify
  truncate -s 100000 "$newest"
  cp "$work/altered.h5" "$work/d/ckpt-00000003.h5"   # well-formed, but its data fails the checksum
  sums=$(md5sum "$work/d/ckpt-00000003.h5" "$newest" | cut -d' ' -f1)
  # Resumed from step 2, the run writes steps 3 and 4 again: the damaged files are moved
  # aside (their bytes kept for whoever looks into the damage), never written over.
  out=$(run 2 "${model[@]}" --steps 5 --checkpoint-every 1 --checkpoint-dir "$work/d" 2>&1) || fail "auto resume failed: $out"
  grep -q "warning: skipping checkpoint: '.*ckpt-00000004.h5'" <<<"$out" || fail "no warning for the truncated file: $out"
  grep -q "warning: skipping checkpoint: '.*ckpt-00000003.h5': .*fails its checksum" <<<"$out" \
    || fail "no warning for the altered file: $out"
  grep -q "resumed from .*ckpt-00000002.h5" <<<"$out" || fail "did not fall back to step 2: $out"
  declare -A said=([3]="failed its checks when this run resumed" [4]="could not be read as a checkpoint")  # 4: truncated
  for step in 3 4; do
    grep -q "warning: '.*ckpt-0000000$step.h5' ${said[$step]}; moved to '.*ckpt-0000000$step.h5.replaced-[0-9]*'" \
      <<<"$out" || fail "ckpt $step was not moved aside: $out"
    "$mpipe" inspect "$work/d/ckpt-0000000$step.h5" --verify >/dev/null || fail "the new ckpt $step does not verify"
  done
  [[ "$(md5sum "$work/d"/ckpt-00000003.h5.replaced-* "$work/d"/ckpt-00000004.h5.replaced-* | cut -d' ' -f1)" == "$sums" ]] \
    || fail "the damaged files' bytes were not kept: $(ls -l "$work/d")"
  expect_error 2 "cannot resume: .*altered.h5.*fails its checksum" run 1 "${model[@]}" --steps 5 --resume "$work/altered.h5"
  ;;
bad-input)
  mkdir "$work/d"
  run 1 "${model[@]}" --steps 2 --checkpoint-dir "$work/d" >/dev/null
  # A missing directory is created, parents included; one under a regular file is refused
  # by name before training, and so is a directory this user cannot write to.
  run 2 "${model[@]}" --steps 2 --checkpoint-dir "$work/new/nested" >/dev/null || fail "a missing --checkpoint-dir"
  [[ -f "$work/new/nested/ckpt-00000002.h5" ]] || fail "no checkpoint in the created directory"
  touch "$work/plain"
  expect_error 2 "cannot create checkpoint directory '$work/plain/sub': .*hint: '$work/plain' is a file" \
    run 2 "${model[@]}" --steps 2 --checkpoint-dir "$work/plain/sub"
  expect_error 2 "cannot create checkpoint directory '$work/plain'" run 2 "${model[@]}" --steps 2 --checkpoint-dir "$work/plain"
  [[ ! -e "$work/plain/sub" && -f "$work/plain" ]] || fail "the blocking file was touched"
  echo "not hdf5" > "$work/text.h5"
  expect_error 2 "is not an HDF5 file" run 2 "${model[@]}" --steps 2 --resume "$work/text.h5"
  other=("${model[@]}")
  other[4]=2   # --layers 2 instead of 3
  expect_error 2 "holds another model" run 2 "${other[@]}" --steps 4 --resume "$work/d/ckpt-00000002.h5"
  cp "$work/d/ckpt-00000002.h5" "$work/v99.h5"
  /usr/bin/python3 -c "import h5py,sys; f=h5py.File(sys.argv[1],'r+'); f.attrs.modify('format_version', 99)" "$work/v99.h5"
  expect_error 2 "format version 99" run 2 "${model[@]}" --steps 4 --resume "$work/v99.h5"
  expect_error 2 "no checkpoint file '/no/such.h5'" run 2 "${model[@]}" --steps 4 --resume /no/such.h5
  # A checkpoint beyond --steps, or of another optimizer, is refused by name: nothing is
  # written, nothing deleted, no older checkpoint taken instead.
  mkdir "$work/ahead"
  run 2 "${model[@]}" --steps 6 --checkpoint-dir "$work/ahead" --checkpoint-every 2 >/dev/null
  before=$(ls "$work/ahead")
  expect_error 2 "checkpoint '.*ckpt-00000006.h5' is at step 6, beyond --steps 3; nothing to do; hint" \
    run 2 "${model[@]}" --steps 3 --checkpoint-dir "$work/ahead" --keep 1
  expect_error 2 "checkpoint '.*ckpt-00000006.h5' holds adamw optimizer state; this run uses --optimizer sgd; hint: use --optimizer adamw" \
    run 2 "${model[@]}" --steps 8 --checkpoint-dir "$work/ahead" --optimizer sgd
  [[ "$(ls "$work/ahead")" == "$before" ]] || fail "refused runs changed the directory: $(ls "$work/ahead")"
  expect_error 2 "is not an HDF5 file" "$mpipe" inspect "$work/text.h5"
  /usr/bin/python3 -c "import h5py,sys; h5py.File(sys.argv[1],'w')['x']=[1.0]" "$work/other.h5"
  expect_error 2 "is not an mpipe checkpoint" "$mpipe" inspect "$work/other.h5"
  # A directory that cannot take the file: the run fails cleanly, the old checkpoint stays.
  before=$(md5sum "$work/d/ckpt-00000002.h5")
  mkdir "$work/d/.ckpt-00000004.h5.tmp"   # the temporary name is taken by a directory
  set +e; out=$(run 2 "${model[@]}" --steps 4 --checkpoint-dir "$work/d" --resume never --overwrite 2>&1); rc=$?; set -e
  [[ $rc -ne 0 ]] || fail "a failed checkpoint exited 0"
  grep -q "error: checkpoint .*ckpt-00000004.h5" <<<"$out" || fail "no checkpoint error: $out"
  [[ "$(md5sum "$work/d/ckpt-00000002.h5")" == "$before" ]] || fail "the old checkpoint changed"
  [[ ! -e "$work/d/ckpt-00000004.h5" ]] || fail "a failed checkpoint was left in place"
  ;;
keep)
  mkdir "$work/d"
  run 2 "${model[@]}" --steps 8 --checkpoint-dir "$work/d" --checkpoint-every 2 --keep 2 >/dev/null
  [[ "$(cd "$work/d" && ls)" == "$(printf 'ckpt-00000006.h5\nckpt-00000008.h5')" ]] || fail "keep 2 left: $(ls -a "$work/d")"
  touch "$work/d/.ckpt-00000010.h5.tmp"   # a stray temporary of a run that died
  run 2 "${model[@]}" --steps 10 --checkpoint-dir "$work/d" --keep 2 >/dev/null
  [[ "$(cd "$work/d" && ls -A)" == "$(printf 'ckpt-00000008.h5\nckpt-00000010.h5')" ]] || fail "after resume: $(ls -A "$work/d")"
  ;;
ownership)
  # A run deletes only what it wrote. Another model's checkpoint, or an earlier run's,
  # makes the directory refused (nothing written, nothing deleted) unless --overwrite.
  mkdir "$work/other" "$work/old"
  other=("${model[@]}"); other[4]=2   # --layers 2
  run 2 "${other[@]}" --steps 2 --checkpoint-dir "$work/other" >/dev/null
  before=$(md5sum "$work/other"/*)
  expect_error 2 "checkpoint directory '.*other' holds 1 checkpoint of another run \(ckpt-00000002.h5\) that this run does not continue; hint: give --overwrite" \
    run 2 "${model[@]}" --steps 4 --checkpoint-dir "$work/other" --keep 1
  [[ "$(md5sum "$work/other"/*)" == "$before" ]] || fail "a refused run changed the other model's checkpoint"
  run 2 "${model[@]}" --steps 6 --checkpoint-dir "$work/old" --checkpoint-every 4 >/dev/null  # ckpt-4, ckpt-6
  before=$(ls -A "$work/old")
  expect_error 2 "holds 2 checkpoints of another run \(ckpt-00000004.h5, ckpt-00000006.h5\); hint: give --overwrite" \
    run 2 "${model[@]}" --steps 4 --checkpoint-dir "$work/old" --resume never --keep 1
  [[ "$(ls -A "$work/old")" == "$before" ]] || fail "a refused run changed the directory: $(ls -A "$work/old")"
  # --overwrite: the old run's files go once the new run's first checkpoint is in place,
  # each named; an auto resume then finds the new run only.
  out=$(run 2 "${model[@]}" --steps 4 --checkpoint-dir "$work/old" --resume never --overwrite --keep 1 --checkpoint-every 2)
  grep -q -- "--overwrite: 2 checkpoints of another run .* will be deleted once" <<<"$out" || fail "no notice: $out"
  grep -q "deleted .*ckpt-00000006.h5 of another run (--overwrite)" <<<"$out" || fail "old ckpt-6 not named: $out"
  grep -q "deleted .*ckpt-00000004.h5 of another run (--overwrite)" <<<"$out" || fail "old ckpt-4 not named: $out"
  [[ "$(ls -A "$work/old")" == "ckpt-00000004.h5" ]] || fail "after --overwrite: $(ls -A "$work/old")"
  # The run continued by --resume auto keeps its id and prunes its own files only; a
  # copy of another run's checkpoint placed beside it stays (and refuses the directory).
  id=$("$mpipe" inspect "$work/old/ckpt-00000004.h5" | awk '$1 == "run_id" {print $2}')
  [[ ${#id} -eq 16 ]] || fail "no run id in inspect"
  run 2 "${model[@]}" --steps 8 --checkpoint-dir "$work/old" --keep 1 --checkpoint-every 2 >/dev/null
  [[ "$(ls -A "$work/old")" == "ckpt-00000008.h5" ]] || fail "keep 1 after resume: $(ls -A "$work/old")"
  [[ "$("$mpipe" inspect "$work/old/ckpt-00000008.h5" | awk '$1 == "run_id" {print $2}')" == "$id" ]] \
    || fail "a resumed run changed its run id"
  cp "$work/other/ckpt-00000002.h5" "$work/old/"
  expect_error 2 "holds 1 checkpoint of another run \(ckpt-00000002.h5\)" \
    run 2 "${model[@]}" --steps 10 --checkpoint-dir "$work/old" --keep 1
  [[ "$(ls -A "$work/old")" == "$(printf 'ckpt-00000002.h5\nckpt-00000008.h5')" ]] || fail "refused: $(ls -A "$work/old")"
  # A file no run can be read from, where this run's next checkpoint goes, is moved
  # aside, not lost.
  rm "$work/old/ckpt-00000002.h5"
  echo "not a checkpoint" > "$work/old/ckpt-00000010.h5"
  out=$(run 2 "${model[@]}" --steps 10 --checkpoint-dir "$work/old" 2>&1) || fail "resume beside an unreadable file: $out"
  grep -q "warning: '.*ckpt-00000010.h5' could not be read as a checkpoint; moved to '.*ckpt-00000010.h5.replaced-[0-9]*'" \
    <<<"$out" || fail "the unreadable file was not moved aside by name: $out"
  grep -qx "not a checkpoint" "$work/old"/ckpt-00000010.h5.replaced-* || fail "the moved file lost its content"
  "$mpipe" inspect "$work/old/ckpt-00000010.h5" --verify >/dev/null || fail "the new ckpt-10 does not verify"
  ;;
lock)
  # One job per checkpoint directory: a second one is refused by name while the first
  # runs, and nothing of the first's is touched; a lock whose job is gone is taken over.
  mkdir "$work/d"
  mpiexec -n 2 --oversubscribe "$mpipe" "${model[@]}" --steps 100000 --checkpoint-dir "$work/d" --checkpoint-every 20 \
    > "$work/first.log" 2>&1 &
  pid=$!
  for _ in $(seq 200); do compgen -G "$work/d/ckpt-*.h5" >/dev/null && break; sleep 0.05; done
  grep -q "^host=$(hostname) pid=[0-9]* job=" "$work/d/.mpipe.lock" || fail "no lock file: $(ls -A "$work/d")"
  for resume in auto never; do
    expect_error 2 "checkpoint directory '.*/d' is in use by another job \(host $(hostname), pid [0-9]+, started .*; lock refreshed [0-9]+ s ago\); hint: .*delete .*\.mpipe\.lock if that job is gone" \
      run 2 "${model[@]}" --steps 100000 --checkpoint-dir "$work/d" --resume "$resume" --overwrite
  done
  kill -USR1 "$pid"
  set +e; wait "$pid"; rc=$?; set -e
  [[ $rc -eq 75 ]] || fail "the first job, stopped, exited $rc: $(grep -v "^step" "$work/first.log" | tail -20)"
  [[ ! -e "$work/d/.mpipe.lock" ]] || fail "the lock outlived its job"
  latest=$(ls "$work/d"/ckpt-*.h5 | tail -1)
  "$mpipe" inspect "$latest" --verify >/dev/null || fail "the first job's last checkpoint does not verify"
  at=$(basename "$latest" .h5); at=$((10#${at#ckpt-}))
  # Stale locks: a process of this host that has ended, or another host's lock not
  # refreshed for two minutes, is taken over with a warning; a fresh one of another host is not.
  echo "host=$(hostname) pid=999999999 job=- restart=0 started=then" > "$work/d/.mpipe.lock"
  out=$(run 2 "${model[@]}" --steps $((at + 1)) --checkpoint-dir "$work/d" 2>&1) || fail "a dead process's lock: $out"
  grep -q "warning: taking over the lock of a job that is gone (host $(hostname), pid 999999999, started then): process 999999999 on this host has ended" \
    <<<"$out" || fail "a dead process's lock: $out"
  [[ ! -e "$work/d/.mpipe.lock" ]] || fail "the taken-over lock was not released"
  echo "host=elsewhere.example pid=1 job=77 restart=0 started=then" > "$work/d/.mpipe.lock"
  expect_error 2 "in use by another job \(host elsewhere.example, pid 1, Slurm job 77, started then" \
    run 2 "${model[@]}" --steps $((at + 2)) --checkpoint-dir "$work/d"
  touch -d '3 minutes ago' "$work/d/.mpipe.lock"
  out=$(run 2 "${model[@]}" --steps $((at + 2)) --checkpoint-dir "$work/d" 2>&1) || fail "an old lock of another host: $out"
  grep -q "taking over the lock .*: it was not refreshed for 1[0-9][0-9] s" <<<"$out" || fail "no takeover notice: $out"
  ;;
state)
  # The attributes that steer a resume are covered by a checksum and cross-checked.
  mkdir "$work/d"
  run 1 "${model[@]}" --steps 6 --checkpoint-dir "$work/d" --checkpoint-every 2 >/dev/null
  "$mpipe" inspect "$work/d/ckpt-00000006.h5" --verify >/dev/null || fail "a good checkpoint fails"
  for attr in step optimizer_updates samples_consumed seed; do
    cp "$work/d/ckpt-00000006.h5" "$work/$attr.h5"
    /usr/bin/python3 -c "import h5py,sys; h5py.File(sys.argv[1],'r+')['/train'].attrs.modify(sys.argv[2], 2)" "$work/$attr.h5" "$attr"
    expect_error 2 "checkpoint damaged: '.*$attr.h5': the training state \(/train and the root attributes\) fails its checksum" \
      "$mpipe" inspect "$work/$attr.h5" --verify
    expect_error 2 "cannot resume: '.*$attr.h5': the training state .* fails its checksum" \
      run 2 "${model[@]}" --steps 8 --resume "$work/$attr.h5"
  done
  cp "$work/d/ckpt-00000006.h5" "$work/cfg.h5"
  /usr/bin/python3 -c "import h5py,sys; f=h5py.File(sys.argv[1],'r+'); f.attrs.modify('optimizer', 'sgd')" "$work/cfg.h5"
  expect_error 2 "training state .* fails its checksum" "$mpipe" inspect "$work/cfg.h5" --verify
  # A checkpoint under another step's name is refused by name.
  cp "$work/d/ckpt-00000006.h5" "$work/ckpt-00000002.h5"
  expect_error 2 "'.*ckpt-00000002.h5' is named for step 2 but holds step 6" "$mpipe" inspect "$work/ckpt-00000002.h5" --verify
  # --resume auto skips an altered newest file, with a warning, for the good one before it.
  cp "$work/step.h5" "$work/d/ckpt-00000006.h5"
  out=$(run 2 "${model[@]}" --steps 8 --checkpoint-dir "$work/d" 2>&1) || fail "auto resume past an altered step: $out"
  grep -q "warning: skipping checkpoint: '.*ckpt-00000006.h5': the training state .* fails its checksum" <<<"$out" \
    || fail "no warning for the altered state: $out"
  grep -q "resumed from .*ckpt-00000004.h5: 4 steps done" <<<"$out" || fail "did not fall back to step 4: $out"
  ;;
stopped)
  # SIGSTOP one rank while checkpoints are written every step (the others then wait in
  # MPI and HDF5 collectives, or in a step): the job ends within --p2p-timeout + 5 s
  # with one line that names the stopped rank. Trials 4 and 5 write 254 MB checkpoints
  # (a write takes longer than the timeout, and the stop most likely falls inside one):
  # still within the timeout + 5 s, not one that grows with the file.
  big=(train --model mlp --layers 6 --hidden 2048 --batch-size 8 --micro-batches 2 --threads 1 --keep 1)
  for trial in 1 2 3 4 5; do
    rm -rf "$work/d"
    if ((trial < 4)); then args=("${model[@]}"); else args=("${big[@]}"); fi
    mpiexec -n 3 --oversubscribe "$mpipe" "${args[@]}" --log-every 1000 --steps 100000 --checkpoint-dir "$work/d" \
      --checkpoint-every $((trial == 3 ? 1000 : 1)) --p2p-timeout 2 > "$work/log" 2>&1 &
    pid=$!
    for _ in $(seq 200); do compgen -G "$work/d/ckpt-*.h5" >/dev/null && break; sleep 0.05; done
    sleep 0.$((RANDOM % 10))
    victim=$(pgrep -P "$pid" -x mpipe | shuf -n 1)
    rank=$(tr '\0' '\n' < "/proc/$victim/environ" | sed -n 's/^OMPI_COMM_WORLD_RANK=//p')
    kill -STOP "$victim"
    start=$(date +%s.%N)
    set +e; wait "$pid"; rc=$?; set -e
    took=$(/usr/bin/python3 -c "import sys,time; print(f'{time.time() - float(sys.argv[1]):.1f}')" "$start")
    [[ $rc -ne 0 ]] || fail "trial $trial: a job with a stopped rank exited 0"
    /usr/bin/python3 -c "import sys; sys.exit(float(sys.argv[1]) > 2 + 5)" "$took" || fail "trial $trial: ended after $took s"
    [[ $(grep -c "mpipe: error" "$work/log") -eq 1 ]] || fail "trial $trial: not one error line: $(grep error "$work/log")"
    grep -Eq "mpipe: error: rank $rank (stopped answering|did not reach)" "$work/log" \
      || fail "trial $trial: rank $rank was stopped, the line names another: $(grep error "$work/log")"
    echo "trial $trial: rank $rank stopped, the job ended in $took s: $(grep "mpipe: error" "$work/log" | cut -c1-160)"
  done
  ;;
model-file)
  # A preset written out as a model file (plan --print-model) is the same model: the same
  # losses and an identical checkpoint, bitwise. A model file splits across stages like
  # a preset (K = 1 and K = 3 bitwise), its checkpoint names it, and a resume with
  # another layer list is refused.
  "$mpipe" plan "${model[@]:1}" --print-model > "$work/gpt.toml"
  run 2 "${model[@]}" --steps 3 --checkpoint-dir "$work/preset" --metrics "$work/preset.jsonl" >/dev/null
  file_model=(train --model "$work/gpt.toml" --batch-size 8 --micro-batches 4 --threads 1 --lr 3e-3 --log-every 1)
  run 2 "${file_model[@]}" --steps 3 --checkpoint-dir "$work/file" --metrics "$work/file.jsonl" >/dev/null
  [[ "$(losses "$work/preset.jsonl")" == "$(losses "$work/file.jsonl")" ]] || fail "preset and model file losses differ"
  same_tensors "$work/preset/ckpt-00000003.h5" "$work/file/ckpt-00000003.h5"
  # transparent FILE K [OPTION...]: the model file on 1 and on K stages ($SCHEDULE, 1f1b
  # by default, remat, and the words of $KARGS), bitwise; the runs' checkpoint directories
  # are $work/k1 and $work/kK.
  transparent() {
    local args=(train --model "$1" --batch-size 8 --micro-batches 4 --threads 1 --lr 3e-3 --log-every 1 --steps 3 "${@:3}")
    rm -rf "$work/k1" "$work/k$2"
    run 1 "${args[@]}" --checkpoint-dir "$work/k1" --metrics "$work/k1.jsonl" >/dev/null
    run "$2" "${args[@]}" --checkpoint-dir "$work/k$2" --metrics "$work/k$2.jsonl" --schedule "${SCHEDULE:-1f1b}" ${KARGS:-} --remat always >/dev/null
    [[ "$(losses "$work/k1.jsonl")" == "$(losses "$work/k$2.jsonl")" ]] || fail "$1: losses differ between K = 1 and $2"
    same_tensors "$work/k1/ckpt-00000003.h5" "$work/k$2/ckpt-00000003.h5"
  }
  # A CNN (convolutions, pools, flatten) on 4 stages, then a language model on 3.
  transparent "$(dirname "$0")/../reference/cnn.toml" 4
  transparent "$(dirname "$0")/../reference/resnet.toml" 4
  # BatchNorm: its running statistics too (a recomputation must not move them again).
  transparent "$(dirname "$0")/../reference/resnet-bn.toml" 4
  # Deferred, they move once per step: the same on any K, and not as the micro-batches move them.
  cp "$work/k4/ckpt-00000003.h5" "$work/micro.h5"
  transparent "$(dirname "$0")/../reference/resnet-bn.toml" 4 --batchnorm deferred
  ! h5diff -q "$work/micro.h5" "$work/k4/ckpt-00000003.h5" /model /model >/dev/null 2>&1 || fail "--batchnorm deferred changed nothing"
  # Zero bubble: convolutions' weight gradients in W, BatchNorm's in B, the same training.
  SCHEDULE=zb-h1 transparent "$(dirname "$0")/../reference/resnet-bn.toml" 4
  SCHEDULE=zb-h2 transparent "$(dirname "$0")/../reference/resnet-bn.toml" 3
  # ZB-V: 2 ranks, 4 model stages in a V (rank 0 holds the stem and the classifier).
  SCHEDULE=zbv transparent "$(dirname "$0")/../reference/resnet-bn.toml" 2
  # Interleaved: model stages s and s + K on a rank, BatchNorm's statistics moved in the
  # micro-batches' order on each; zb-h1 at 1F1B's memory (--in-flight 1f1b) too.
  SCHEDULE=interleaved KARGS="--virtual-stages 2" transparent "$(dirname "$0")/../reference/resnet-bn.toml" 2
  SCHEDULE=zb-h1 KARGS="--in-flight 1f1b" transparent "$(dirname "$0")/../reference/resnet-bn.toml" 4
  # ... and they resume and reshard: the step-3 checkpoint of a 5-step run on 2 stages,
  # resumed on 4, ends as the unbroken run.
  bn=(train --model "$(dirname "$0")/../reference/resnet-bn.toml" --batch-size 8 --micro-batches 4 --threads 1 --lr 3e-3
      --steps 5)
  run 2 "${bn[@]}" --checkpoint-every 3 --checkpoint-dir "$work/bn" >/dev/null
  mkdir "$work/bn4" && cp "$work/bn/ckpt-00000003.h5" "$work/bn4/"
  out=$(run 4 "${bn[@]}" --checkpoint-dir "$work/bn4" 2>&1) || fail "BatchNorm resume on 4 stages: $out"
  grep -q "resumed from .*ckpt-00000003.h5" <<<"$out" || fail "BatchNorm model did not resume: $out"
  same_tensors "$work/bn/ckpt-00000005.h5" "$work/bn4/ckpt-00000005.h5"
  # The resnet preset (a narrow ResNet-18: BatchNorm on the projections, zero-init scales).
  "$mpipe" plan --model resnet --width 4 --image 8 --classes 5 --print-model > "$work/resnet18.toml"
  transparent "$work/resnet18.toml" 4
  transparent "$(dirname "$0")/../cli/models/tiny_lm.toml" 3
  "$mpipe" inspect "$work/k3/ckpt-00000003.h5" --config | grep -q "^model = \".*tiny_lm.toml\"$" || fail "inspect --config lacks the model file"
  # The same file elsewhere resumes; another layer list is refused by name.
  cp "$(dirname "$0")/../cli/models/tiny_lm.toml" "$work/moved.toml"
  out=$(run 1 train --model "$work/moved.toml" --batch-size 8 --micro-batches 4 --threads 1 --lr 3e-3 --steps 4 \
        --checkpoint-dir "$work/k1" 2>&1) || fail "resume from the same layer list elsewhere: $out"
  grep -q "resumed from .*ckpt-00000003.h5" <<<"$out" || fail "did not resume: $out"
  sed 's/^out = 64$/out = 48/' "$work/moved.toml" > "$work/other.toml"
  expect_error 2 "ckpt-00000004.h5' holds another model \(layer 4 \(linear\): out = 64 there, out = 48 here\)" \
    run 1 train --model "$work/other.toml" --batch-size 8 --micro-batches 4 --threads 1 --resume "$work/k1/ckpt-00000004.h5"
  # The checkpoint's own layer list is a model file that continues it.
  "$mpipe" inspect "$work/k1/ckpt-00000004.h5" --model > "$work/from_ckpt.toml"
  out=$(run 1 train --model "$work/from_ckpt.toml" --batch-size 8 --micro-batches 4 --threads 1 --lr 3e-3 --steps 5 \
        --checkpoint-dir "$work/k1" 2>&1) || fail "resume with inspect --model's file: $out"
  grep -q "resumed from .*ckpt-00000004.h5" <<<"$out" || fail "inspect --model's file did not resume: $out"
  ;;
eval)
  # Evaluation on held-out data changes nothing in training (losses and checkpoint
  # bitwise with and without it) and is the same on any number of stages.
  # A language model with dropout (off in evaluation): token accuracy and perplexity.
  args=(train --model "$(dirname "$0")/../cli/models/tiny_lm.toml" --batch-size 8 --micro-batches 4 --threads 1
        --lr 3e-3 --log-every 1 --steps 4)
  run 2 "${args[@]}" --checkpoint-dir "$work/plain" --metrics "$work/plain.jsonl" >/dev/null
  run 2 "${args[@]}" --checkpoint-dir "$work/e2" --metrics "$work/e2.jsonl" --eval-data synthetic --eval-every 2 \
    --eval-batches 3 > "$work/e2.log"
  [[ "$(losses "$work/plain.jsonl")" == "$(losses "$work/e2.jsonl")" ]] || fail "evaluation changed the training losses"
  same_tensors "$work/plain/ckpt-00000004.h5" "$work/e2/ckpt-00000004.h5"
  [[ $(grep -c "^eval step [24] | loss [0-9.]* | token accuracy [0-9.]*% | 24 samples | perplexity [0-9.]*$" "$work/e2.log") -eq 2 ]] \
    || fail "expected eval lines at steps 2 and 4: $(cat "$work/e2.log")"
  run 4 "${args[@]}" --checkpoint-dir "$work/e4" --eval-data synthetic --eval-every 2 --eval-batches 3 > "$work/e4.log"
  [[ "$(grep "^eval" "$work/e2.log")" == "$(grep "^eval" "$work/e4.log")" ]] || fail "eval differs between K = 2 and 4"
  evals=$(/usr/bin/python3 -c "import json,sys; print(sum('eval_loss' in json.loads(l) for l in open(sys.argv[1])))" "$work/e2.jsonl")
  [[ $evals -eq 2 ]] || fail "expected 2 eval records in the metrics, got $evals"
  expect_error 2 "--eval-every and --eval-batches need --eval-data" run 1 "${args[@]}" --eval-every 2
  # BatchNorm evaluates on its running statistics: the same on 1 and 3 stages.
  bn=(train --model "$(dirname "$0")/../reference/resnet-bn.toml" --batch-size 8 --micro-batches 4 --threads 1 --steps 4
      --eval-data synthetic --eval-every 2 --eval-batches 2)
  run 1 "${bn[@]}" > "$work/bn1.log"
  run 3 "${bn[@]}" --remat always > "$work/bn3.log"
  [[ $(grep -c "^eval step" "$work/bn1.log") -eq 2 ]] || fail "BatchNorm model: no eval lines: $(cat "$work/bn1.log")"
  [[ "$(grep "^eval" "$work/bn1.log")" == "$(grep "^eval" "$work/bn3.log")" ]] || fail "BatchNorm eval differs between K = 1 and 3"
  ;;
image-data)
  # A real data set: the digits, a 2-stage CNN, and a held-out accuracy of at least 97%.
  bash "$(dirname "$0")/../../scripts/make_digits.sh" "$work/digits" >/dev/null
  digits=(train --model "$(dirname "$0")/../../inputs/digits-cnn.toml" --data "hdf5:$work/digits/digits-train.h5"
          --eval-data "hdf5:$work/digits/digits-test.h5" --batch-size 32 --micro-batches 4 --threads 1 --lr 3e-3
          --log-every 100)
  out=$(run 2 "${digits[@]}" --steps 300 2>&1) || fail "digits: $out"
  accuracy=$(sed -n 's/^eval step 300 | loss [0-9.]* | accuracy \([0-9.]*\)% | 352 samples (of 359 in the file: 7 left out, less than a batch)$/\1/p' <<<"$out")
  [[ -n "$accuracy" ]] || fail "no final evaluation: $out"
  /usr/bin/python3 -c "import sys; sys.exit(float(sys.argv[1]) < 97)" "$accuracy" || fail "digits test accuracy $accuracy% < 97%"
  echo "digits: test accuracy $accuracy% after 300 steps"
  # A residual network with BatchNorm (three blocks, a projection) too, at 400 steps.
  digits[2]="$(dirname "$0")/../../inputs/resnet-digits.toml"
  out=$(run 2 "${digits[@]}" --steps 400 2>&1) || fail "resnet digits: $out"
  accuracy=$(sed -n 's/^eval step 400 | loss [0-9.]* | accuracy \([0-9.]*\)% | 352 samples (of 359 in the file: 7 left out, less than a batch)$/\1/p' <<<"$out")
  /usr/bin/python3 -c "import sys; sys.exit(float(sys.argv[1]) < 97)" "${accuracy:-0}" || fail "resnet digits accuracy '$accuracy' < 97%"
  echo "resnet digits: test accuracy $accuracy% after 400 steps"
  # --eval-batches: the line says how many of the file's samples it left out.
  out=$(run 2 "${digits[@]}" --steps 1 --eval-batches 2 2>&1) || fail "--eval-batches 2: $out"
  grep -Eq "^eval step 1 \| .* \| 64 samples \(of 359 in the file: 295 left out, beyond --eval-batches\)$" <<<"$out" \
    || fail "--eval-batches 2: the line does not say what it left out: $out"
  # Bad files: one line, exit 2, before training.
  /usr/bin/python3 - "$work" <<'PY'
import sys, h5py, numpy as np
w = sys.argv[1]
def make(name, **sets):
    with h5py.File(f"{w}/{name}.h5", "w") as f:
        for key, value in sets.items():
            f.create_dataset(key, data=value)
x, y = np.zeros((10, 1, 8, 8), np.float32), np.arange(10, dtype=np.int32)
make("no_labels", inputs=x)
make("wrong_shape", inputs=np.zeros((10, 1, 8, 7), np.float32), labels=y)
make("label_range", inputs=x, labels=np.full(10, 10, np.int32))
make("label_count", inputs=x, labels=y[:9])
make("uint8", inputs=np.full((10, 1, 8, 8), 255, np.uint8), labels=y)
make("float_labels", inputs=x, labels=np.arange(10, dtype=np.float32) + 0.5)
make("two", inputs=x[:2], labels=y[:2])
PY
  model=(train --model "$(dirname "$0")/../../inputs/digits-cnn.toml" --batch-size 8 --threads 1 --steps 1)
  expect_error 2 "no_labels.h5' has no /labels dataset" run 1 "${model[@]}" --data "hdf5:$work/no_labels.h5"
  expect_error 2 "wrong_shape.h5': /inputs is \(10, 1, 8, 7\), the model takes \(N, 1, 8, 8\)" \
    run 1 "${model[@]}" --data "hdf5:$work/wrong_shape.h5"
  expect_error 2 "label 10 of sample 0 is out of range; hint: labels must be 0 to 9" \
    run 1 "${model[@]}" --data "hdf5:$work/label_range.h5"
  expect_error 2 "/labels has 9 entries for 10 samples" run 1 "${model[@]}" --eval-data "hdf5:$work/label_count.h5"
  expect_error 2 "is not an HDF5 file" run 1 "${model[@]}" --data "hdf5:$(dirname "$0")/../../inputs/cnn.toml"
  run 1 "${model[@]}" --data "hdf5:$work/uint8.h5" >/dev/null || fail "uint8 inputs were refused"
  # Floating-point labels (0.5 ... 9.5) would be truncated to classes: refused.
  expect_error 2 "float_labels.h5': /labels is not of an integer type; hint: store /labels as integers" \
    run 1 "${model[@]}" --data "hdf5:$work/float_labels.h5"
  # Evaluation takes each held-out sample at most once: a file smaller than a batch, or
  # fewer samples than --eval-batches asks for, is refused (it used to repeat them).
  expect_error 2 "--eval-data has 2 samples, fewer than one batch of 8: evaluation would repeat samples; hint" \
    run 1 "${model[@]}" --eval-data "hdf5:$work/two.h5"
  expect_error 2 "--eval-batches 5 of 8 samples need 40 held-out samples, --eval-data has 10: evaluation would repeat" \
    run 1 "${model[@]}" --eval-data "hdf5:$work/uint8.h5" --eval-batches 5
  ;;
hostile)
  # Files an attacker or a bad tool might make of a good checkpoint: `inspect --verify`
  # refuses each for the reason resume does (one set of rules), `--stats` reads none of
  # the bad datasets (no allocation by a size the file claims) and marks them FAILED, and
  # nothing crashes.
  mkdir "$work/d" "$work/bad"
  run 1 "${model[@]}" --steps 2 --checkpoint-dir "$work/d" >/dev/null
  good="$work/d/ckpt-00000002.h5"
  /usr/bin/python3 - "$good" "$work/bad" <<'PY'
import h5py, numpy as np, shutil, sys, zlib
src, out = sys.argv[1], sys.argv[2]
def copy(name):
    path = f"{out}/{name}.h5"; shutil.copy(src, path); return h5py.File(path, "r+")
def crc(a): return np.uint32(zlib.crc32(np.ascontiguousarray(a, dtype=np.float32).tobytes()))
def replace(f, name, data):
    del f[name]; d = f.create_dataset(name, data=data); d.attrs["crc32"] = crc(np.asarray(data, dtype=np.float32))
wte, wpe, state = "/model/0000/wte", "/model/0000/wpe", "/optimizer/exp_avg/0000/wte"
with copy("huge") as f:  # chunked, never allocated: 2^60 elements that HDF5 would "read" as fill values
    del f[wte]; f.create_dataset(wte, shape=(2**60,), dtype="f4", chunks=(1024,)).attrs["crc32"] = np.uint32(0)
with copy("huge_state") as f:
    del f[state]; f.create_dataset(state, shape=(2**40, 32), dtype="f4", chunks=(1, 32)).attrs["crc32"] = np.uint32(0)
with copy("no_state") as f: del f["/optimizer/exp_avg_sq"]
with copy("no_model") as f: del f["/model"]
with copy("half_rows") as f: v = f[state][()]; replace(f, state, v[: v.shape[0] // 2])
with copy("scalar") as f: replace(f, wpe, np.float32(1.0))
with copy("int32") as f: v = f[wpe][()]; del f[wpe]; d = f.create_dataset(wpe, data=v.astype(np.int32)); d.attrs["crc32"] = crc(v.astype(np.int32))
with copy("external") as f: del f[wpe]; f[wpe] = h5py.ExternalLink("other.h5", "/x")
with copy("loop") as f: del f[wpe]; f[wpe] = h5py.SoftLink(wpe)
with copy("alias") as f:  # one state standing in for the other, its checksum valid
    n = "/optimizer/exp_avg/0000/wpe"; del f[n]; f[n] = h5py.SoftLink("/optimizer/exp_avg_sq/0000/wpe")
with copy("unallocated") as f:  # contiguous, the right shape, never written
    d = f[wpe]; shape = d.shape; c = d.attrs["crc32"]; del f[wpe]
    f.create_dataset(wpe, shape=shape, dtype="f4").attrs["crc32"] = c
PY
  declare -A why=([huge]="/model/0000/wte is \(1152921504606846976\), expected \(64, 32\)"
                  [huge_state]="/optimizer/exp_avg/0000/wte is \(1099511627776, 32\), expected \(64, 32\)"
                  [no_state]="group /optimizer/exp_avg_sq is missing" [no_model]="group /model is missing"
                  [half_rows]="/optimizer/exp_avg/0000/wte is \(32, 32\), expected \(64, 32\)"
                  [scalar]="/model/0000/wpe is a scalar, expected \(16, 32\)"
                  [int32]="/model/0000/wpe is not float32" [external]="/model/0000/wpe is an external link"
                  [loop]="/model/0000/wpe is a soft link" [alias]="/optimizer/exp_avg/0000/wpe is a soft link"
                  [unallocated]="/model/0000/wpe has no data stored")
  for name in "${!why[@]}"; do
    f="$work/bad/$name.h5"
    expect_error 2 "checkpoint damaged: '$f': dataset ${why[$name]}|checkpoint damaged: '$f': ${why[$name]}" \
      "$mpipe" inspect "$f" --verify
    expect_error 2 "cannot resume: '$f': (dataset )?${why[$name]}" run 1 "${model[@]}" --steps 3 --resume "$f"
    # --stats applies the same rules (issue 64): the dataset marked FAILED, exit 2 at the end.
    set +e; out=$("$mpipe" inspect "$f" --stats 2>&1); rc=$?; set -e
    [[ $rc -eq 2 ]] || fail "inspect --stats of $name: exit $rc: $out"
    [[ $(grep -c "error" <<<"$out") -eq 1 ]] || fail "inspect --stats of $name: not one error line: $out"
    grep -Eq "FAILED \((dataset )?${why[$name]}" <<<"$out" || fail "inspect --stats of $name: not marked FAILED: $out"
    grep -Eq "mpipe: error: checkpoint damaged: (dataset )?${why[$name]}" <<<"$out" || fail "inspect --stats of $name: $out"
  done
  "$mpipe" inspect "$good" --verify --stats >/dev/null || fail "the good file does not verify"
  # A layer list that no longer gives the parameters the signature names.
  cp "$good" "$work/list.h5"
  /usr/bin/python3 -c "import h5py,sys; f=h5py.File(sys.argv[1],'r+'); f.attrs.modify('model', f.attrs['model'].replace(b'out = 32', b'out = 48'))" \
    "$work/list.h5"
  expect_error 2 "its layer list does not give the parameters its signature names" "$mpipe" inspect "$work/list.h5" --verify
  ;;
data-changed)
  # A data file truncated or rewritten in place while a run reads it: HDF5 reads zeros
  # past the new end without an error (the run trained on nothing to its last step and
  # exited 0). The run must stop at the step that reads it, exit 2, one line naming the
  # file, as training data (with --prefetch too) and as held-out data.
  bash "$(dirname "$0")/../../scripts/make_digits.sh" "$work/digits" >/dev/null
  digits=(train --model "$(dirname "$0")/../../inputs/digits-cnn.toml" --batch-size 32 --micro-batches 4 --threads 1 --log-every 1)
  for how in train prefetch eval rewrite; do
    cp "$work/digits/digits-train.h5" "$work/d.h5"
    case $how in
      train|rewrite) data=(--data "hdf5:$work/d.h5") ;;
      prefetch) data=(--data "hdf5:$work/d.h5" --prefetch on) ;;
      eval) data=(--data "hdf5:$work/digits/digits-train.h5" --eval-data "hdf5:$work/d.h5" --eval-every 1 --eval-batches 1) ;;
    esac
    run 2 "${digits[@]}" "${data[@]}" --steps 100000 > "$work/log" 2>&1 & pid=$!
    for _ in $(seq 600); do grep -q "^step  *3/" "$work/log" && break; sleep 0.1; done
    grep -q "^step  *3/" "$work/log" || fail "$how: no third step: $(cat "$work/log")"
    if [[ $how == rewrite ]]; then  # the same size, other bytes (rewritten in place)
      HDF5_USE_FILE_LOCKING=FALSE /usr/bin/python3 -c "import h5py,sys; f=h5py.File(sys.argv[1],'r+'); f['inputs'][0] = 0" "$work/d.h5"
    else
      truncate -s 5000 "$work/d.h5"
    fi
    ( sleep 60; kill -9 "$pid" 2>/dev/null ) & guard=$!
    set +e; wait "$pid"; rc=$?; set -e
    kill "$guard" 2>/dev/null || true
    [[ $rc -eq 2 ]] || fail "$how: exit $rc after the data file changed: $(tail -5 "$work/log")"
    [[ $(grep -c "mpipe: error" "$work/log") -eq 1 ]] || fail "$how: not one error line: $(cat "$work/log")"
    grep -Eq "mpipe: error: rank 0 .* at (step [0-9]+|evaluation batch 0) reading the batch: hdf5 file .*d.h5 changed while training read it \(.*\); hint" \
      "$work/log" || fail "$how: the line does not name the file: $(grep error "$work/log")"
    echo "$how: $(grep "mpipe: error" "$work/log" | cut -c1-120)"
  done
  ;;
async)
  # --checkpoint-async on: the files are the synchronous run's (every dataset, and /train's
  # step, updates, samples and position) and verify; the log says which were written in
  # the background.
  mkdir "$work/sync" "$work/async"
  run 2 "${model[@]}" --steps 6 --checkpoint-every 2 --checkpoint-dir "$work/sync" > /dev/null
  out=$(run 2 "${model[@]}" --steps 6 --checkpoint-every 2 --checkpoint-dir "$work/async" --checkpoint-async on)
  grep -q "^checkpoint step 2: writing in the background (training waited [0-9.]* s)" <<<"$out" || fail "no background line: $out"
  grep -q "ckpt-00000002.h5 written in the background" <<<"$out" || fail "step 2's write not reported: $out"
  grep -q "ckpt-00000006.h5 written: " <<<"$out" || fail "the final checkpoint not written at once: $out"
  for s in 2 4 6; do
    name=ckpt-0000000$s.h5
    same_tensors "$work/sync/$name" "$work/async/$name"
    "$mpipe" inspect "$work/async/$name" --verify > /dev/null || fail "$name does not verify"
    /usr/bin/python3 - "$work/sync/$name" "$work/async/$name" <<'PY' || fail "/train of $name differs"
import sys, h5py
a, b = (dict(h5py.File(p, "r")["train"].attrs) for p in sys.argv[1:])
keys = ("step", "optimizer_updates", "samples_consumed", "data_position", "seed", "data")
sys.exit(0 if all(a[k] == b[k] for k in keys) else 1)
PY
  done
  # The thread leaves the whole copy to the next update (MPIPE_CHECKPOINT_COPY_AT_UPDATE),
  # so a file differs from the synchronous one if anything changes the state before that
  # update has copied it: a U-Net's BatchNorm running statistics (changed by the next
  # step's forwards: copied at the step), and --overlap-steps (the update made ahead).
  unet=(train --model "$(dirname "$0")/../../inputs/unet.toml" --batch-size 8 --micro-batches 2 --threads 1 --log-every 1)
  for variant in unet overlap; do
    if [[ $variant == unet ]]; then args=("${unet[@]}"); else args=("${model[@]}" --overlap-steps); fi
    mkdir "$work/$variant-sync" "$work/$variant-async"
    run 2 "${args[@]}" --steps 4 --checkpoint-every 2 --checkpoint-dir "$work/$variant-sync" > /dev/null
    MPIPE_CHECKPOINT_COPY_AT_UPDATE=1 mpiexec -n 2 -x MPIPE_CHECKPOINT_COPY_AT_UPDATE --oversubscribe "$mpipe" "${args[@]}" \
      --steps 4 --checkpoint-every 2 --checkpoint-dir "$work/$variant-async" --checkpoint-async on > "$work/$variant.log" \
      || fail "$variant: $(cat "$work/$variant.log")"
    grep -q "ckpt-00000002.h5 written in the background: .*; the next update waited [0-9.]* s for the copy" "$work/$variant.log" \
      || fail "$variant: step 2's write not reported: $(cat "$work/$variant.log")"
    same_tensors "$work/$variant-sync/ckpt-00000002.h5" "$work/$variant-async/ckpt-00000002.h5"
  done
  # A background write that fails (a full disk: a tmpfs with room for one checkpoint, not
  # two) is reported at the next step, not at the next checkpoint or the end: one error
  # line, exit 1, the checkpoint before it in place and verifying. In a mount namespace
  # of its own, so that no mount outlives the test (the files are checked in it).
  # on_tmpfs NAME BYTES ARGS...: a 2-rank run of ARGS whose --checkpoint-dir is a tmpfs of
  # BYTES at $work/NAME; NAME.log and NAME.rc, and what the tmpfs held, read before it
  # goes: NAME.ls and NAME.verify (each checkpoint that verifies).
  on_tmpfs() {
    local name=$1 bytes=$2; shift 2
    mkdir "$work/$name"
    unshare --mount --propagation private bash -c '
      mpipe=$1 dir=$2 bytes=$3; shift 3
      mount -t tmpfs -o size=$bytes tmpfs "$dir" || exit 99
      mpiexec -n 2 --oversubscribe "$mpipe" "$@" --checkpoint-dir "$dir" > "$dir.log" 2>&1
      echo $? > "$dir.rc"
      ls "$dir" > "$dir.ls"
      for f in "$dir"/ckpt-*.h5; do "$mpipe" inspect "$f" --verify > /dev/null && echo "$(basename "$f") verifies"; done > "$dir.verify"
      exit 0
    ' _ "$mpipe" "$work/$name" "$bytes" "$@" || fail "cannot run in a mount namespace with a tmpfs (exit $?)"
  }
  size=$(stat -c %s "$work/async/ckpt-00000002.h5")
  on_tmpfs full "$((size * 3 / 2))" "${model[@]}" --steps 400 --checkpoint-every 100 --keep 1 --checkpoint-async on --log-every 100
  rc=$(cat "$work/full.rc")
  [[ $rc -eq 1 ]] || fail "a failed background write: exit $rc: $(cat "$work/full.log")"
  [[ $(grep -c "error" "$work/full.log") -eq 1 ]] || fail "a failed background write: not one error line: $(cat "$work/full.log")"
  grep -Eq "^mpipe: error: checkpoint .*ckpt-00000200.h5: .*(No space left|disk full)" "$work/full.log" \
    || fail "the failure does not name the checkpoint and the full disk: $(cat "$work/full.log")"
  stopped=$(sed -n 's/^step \([0-9]*\): the background checkpoint write failed; exiting with code 1$/\1/p' "$work/full.log")
  [[ -n $stopped && $stopped -gt 200 && $stopped -lt 300 ]] \
    || fail "the failure not reported at a step after 200 and before the next checkpoint: $(cat "$work/full.log")"
  [[ "$(cat "$work/full.ls")" == "ckpt-00000100.h5" ]] || fail "the directory after the failure: $(cat "$work/full.ls")"
  grep -q "ckpt-00000100.h5 verifies" "$work/full.verify" || fail "the checkpoint before the failure does not verify"
  echo "a failed background write of step 200: reported at step $stopped, ckpt-00000100.h5 in place"
  # The final checkpoint, written at the end (not in the background), on a disk with room
  # for half of it: the error line says the disk is full, whichever HDF5 call met it (a
  # flush said only "cannot flush").
  on_tmpfs half "$((size / 2))" "${model[@]}" --steps 3
  rc=$(cat "$work/half.rc")
  [[ $rc -ne 0 ]] || fail "a final checkpoint on a full disk: exit 0: $(cat "$work/half.log")"
  grep -Eq "error: .*No space left on device" "$work/half.log" \
    || fail "the final checkpoint's failure does not say the disk is full: $(cat "$work/half.log")"
  echo "a final checkpoint on a full disk: exit $rc, $(grep -o 'error: .*' "$work/half.log" | head -1 | cut -c1-120)"
  # kill -9 of the whole job while writes run in the background (one every step): every
  # checkpoint left verifies, and the run resumes to the end with the unbroken run's
  # final weights.
  mkdir "$work/killed" "$work/whole"
  run 2 "${model[@]}" --steps 30 --checkpoint-dir "$work/whole" > /dev/null
  mpiexec -n 2 --oversubscribe "$mpipe" "${model[@]}" --steps 30 --checkpoint-every 1 --keep 3 --checkpoint-async on \
    --checkpoint-dir "$work/killed" --metrics "$work/k.jsonl" > "$work/k.log" 2>&1 &
  pid=$!
  for _ in $(seq 400); do [[ -s "$work/k.jsonl" && $(wc -l < "$work/k.jsonl") -ge 6 ]] && break; sleep 0.05; done
  pkill -9 -P "$pid" 2>/dev/null || true
  set +e; wait "$pid"; set -e
  ls "$work/killed"/ckpt-*.h5 > /dev/null 2>&1 || fail "no checkpoint left after the kill: $(tail -3 "$work/k.log")"
  for f in "$work/killed"/ckpt-*.h5; do "$mpipe" inspect "$f" --verify > /dev/null || fail "$f does not verify after the kill"; done
  out=$(run 2 "${model[@]}" --steps 30 --checkpoint-dir "$work/killed" --checkpoint-async on) || fail "resume after the kill: $out"
  grep -q "resumed from" <<<"$out" || fail "did not resume after the kill: $out"
  same_tensors "$work/whole/ckpt-00000030.h5" "$work/killed/ckpt-00000030.h5"
  # SIGUSR1 while a write runs: the write in flight is waited for, then the stop's own
  # checkpoint, complete; exit 75.
  mkdir "$work/usr1"
  mpiexec -n 2 --oversubscribe "$mpipe" "${model[@]}" --steps 100000 --checkpoint-every 1 --keep 2 --checkpoint-async on \
    --checkpoint-dir "$work/usr1" --metrics "$work/u.jsonl" > "$work/u.log" 2>&1 &
  pid=$!
  for _ in $(seq 400); do [[ -s "$work/u.jsonl" && $(wc -l < "$work/u.jsonl") -ge 6 ]] && break; sleep 0.05; done
  kill -USR1 "$pid"
  set +e; wait "$pid"; rc=$?; set -e
  [[ $rc -eq 75 ]] || fail "SIGUSR1 with a write in flight: exit $rc: $(tail -5 "$work/u.log")"
  newest=$(ls "$work/usr1"/ckpt-*.h5 | tail -1)
  stopped=$(sed -n 's/^step \([0-9]*\): stop signal received.*/\1/p' "$work/u.log")
  [[ -n $stopped && $newest == *"ckpt-$(printf %08d "$stopped").h5" ]] || fail "the newest checkpoint $newest is not the stop's (step $stopped)"
  "$mpipe" inspect "$newest" --verify > /dev/null || fail "$newest does not verify"
  ;;
*) fail "unknown case $case" ;;
esac
echo "ok: checkpoint $case"
