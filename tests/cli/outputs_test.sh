#!/usr/bin/env bash
# The commands' standard output, checkpoint damage under inspect --stats, and the outputs
# that may not name the checkpoint directory's lock (issue 64, groups A, C and D), with the
# real binary. Each failure: the exit code, and exactly one error line naming the cause.
# Usage: outputs_test.sh MPIPE CASE   (CASE: plan-full, print-model-full, closed, inspect-full, generate-full,
#        generate-pipe, mpi-generate-full, mpi-generate-pipe, stats-damaged, lock-output or minor)
set -uo pipefail
mpipe=$1 case=$2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { printf 'FAIL: %s\n%s\n' "$1" "${2:-}"; exit 1; }
# expect CODE REGEX COMMAND: run it (through bash -c, for its redirections; pipefail), its
# exit code, exactly one error line, one line matching REGEX, and its time under 30 s.
expect() {
  local code=$1 regex=$2 command=$3 start took out rc
  start=$(date +%s.%N)
  out=$(timeout 60 bash -c "set -o pipefail; $command" 2>&1); rc=$?
  took=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  what="'$command': exit $rc after $took s"
  [[ $rc -eq $code ]] || fail "$what, expected $code" "$out"
  [[ $(grep -c 'error' <<<"$out") -eq 1 ]] || fail "$what: not exactly one error line" "$out"
  grep -Eq -- "$regex" <<<"$out" || fail "$what: no line matching /$regex/" "$out"
  awk -v t="$took" 'BEGIN { exit !(t < 30) }' || fail "$what: too slow" "$out"
  echo "ok: $what: $(grep error <<<"$out" | cut -c1-160)"
}
full="mpipe: error: cannot write to standard output: No space left on device; hint"
checkpoint() {  # a tiny GPT's checkpoint in $work/run: $ckpt
  rm -rf "$work/run"
  "$mpipe" train --model gpt --layers 2 --d-model 16 --heads 2 --seq-len 16 --vocab 256 --batch-size 2 --micro-batches 1 \
    --steps 2 --threads 1 --checkpoint-dir "$work/run" >/dev/null 2>&1 || fail "the training run failed"
  ckpt=$(ls "$work"/run/ckpt-*.h5 | tail -1)
}
generate="generate --threads 1 --temperature 0 --prompt hi"

case $case in
plan-full)
  expect 1 "$full" "'$mpipe' plan --ranks 2 >/dev/full"
  expect 1 "$full" "'$mpipe' train --layers 1 --d-model 16 --heads 2 --seq-len 16 --batch-size 2 --micro-batches 1 --steps 1 --threads 1 >/dev/full"
  expect 1 "$full" "'$mpipe' --help >/dev/full"
  ;;
print-model-full)
  expect 1 "$full" "'$mpipe' plan --print-model >/dev/full"
  expect 1 "$full" "'$mpipe' plan --layer-kinds >/dev/full"
  ;;
closed)
  # Refused before any work (a file the command opened would take the closed number).
  for command in "plan --ranks 2" "plan --print-model" "--version" "train --steps 1 --threads 1"; do
    expect 2 "mpipe: error: cannot write to standard output: it is closed; hint" "'$mpipe' $command >&-"
  done
  ;;
inspect-full)
  checkpoint
  for flags in "--config" "--model" "" "--stats" "--verify"; do
    expect 1 "$full" "'$mpipe' inspect '$ckpt' $flags >/dev/full"
  done
  expect 1 "$full" "'$mpipe' export '$ckpt' '$work/out.safetensors' >/dev/full"  # its summary line
  # What a full disk must not leave unsaid: an empty run.toml that train reads as the default.
  "$mpipe" inspect "$ckpt" --config > "$work/run.toml" || fail "inspect --config to a file failed"
  grep -q "layers = 2" "$work/run.toml" || fail "run.toml lacks the run's options" "$(cat "$work/run.toml")"
  ;;
generate-full)
  checkpoint
  expect 1 "$full" "'$mpipe' $generate --checkpoint '$ckpt' --tokens 1000 >/dev/full"
  expect 1 "$full" "'$mpipe' $generate --checkpoint '$ckpt' --tokens 50 --samples 3 >/dev/full"
  out=$("$mpipe" $generate --checkpoint "$ckpt" --tokens 1000 2>&1 >/dev/full)
  if grep -q "generated" <<<"$out"; then fail "a failed generation says it generated" "$out"; fi
  ;;
generate-pipe)
  # A reader gone ends generation promptly, whatever SIGPIPE's disposition (ignored here).
  checkpoint
  expect 1 "cannot write to standard output: Broken pipe" \
    "trap '' PIPE; '$mpipe' $generate --checkpoint '$ckpt' --tokens 100000000 | head -c 10 >/dev/null"
  # Several samples print at the end: the reader's going is found between tokens.
  expect 1 "cannot write to standard output: Broken pipe" \
    "trap '' PIPE; '$mpipe' $generate --checkpoint '$ckpt' --tokens 100000000 --samples 2 | (exec 0<&-; sleep 1)"
  # SIGPIPE as it comes: the signal ends it.
  start=$(date +%s)
  timeout 60 bash -c "'$mpipe' $generate --checkpoint '$ckpt' --tokens 100000000 | head -c 10 >/dev/null" 2>/dev/null
  (( $(date +%s) - start < 30 )) || fail "generate into a closed pipe (SIGPIPE default) went on"
  echo "ok: SIGPIPE default"
  ;;
mpi-generate-full)
  # Under mpirun rank 0's output goes through mpirun, which drops a failed write silently.
  checkpoint
  expect 1 "$full" "mpiexec -n 2 --oversubscribe '$mpipe' $generate --checkpoint '$ckpt' --tokens 500 >/dev/full"
  expect 1 "$full" "mpiexec -n 1 '$mpipe' plan --ranks 2 >/dev/full"
  ;;
mpi-generate-pipe)
  # Tokens printed as they come: mpirun finds its reader gone itself, at a write (it aborts
  # the job, exit 1, in words of its own). The job must end promptly, not generate on.
  checkpoint
  start=$(date +%s.%N)
  timeout 60 bash -c "set -o pipefail; trap '' PIPE; mpiexec -n 2 --oversubscribe '$mpipe' $generate --checkpoint '$ckpt' \
    --tokens 100000000 | head -c 10 >/dev/null" >/dev/null 2>&1
  rc=$?
  took=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  [[ $rc -ne 0 && $rc -ne 124 ]] || fail "into a closed pipe under mpirun: exit $rc after $took s"
  awk -v t="$took" 'BEGIN { exit !(t < 30) }' || fail "into a closed pipe under mpirun: too slow ($took s)"
  echo "ok: into a closed pipe under mpirun: exit $rc after $took s"
  # Several samples print at the end: rank 0 finds mpirun's reader gone between tokens.
  expect 1 "cannot write to standard output: Broken pipe" \
    "trap '' PIPE; mpiexec -n 2 --oversubscribe '$mpipe' $generate --checkpoint '$ckpt' --tokens 100000000 --samples 2 | (exec 0<&-; sleep 1)"
  ;;
stats-damaged)
  # One flipped byte in a tensor's data: FAILED on its line, the others' statistics, exit 2.
  checkpoint
  out=$("$mpipe" inspect "$ckpt" --stats 2>&1) || fail "--stats of a good checkpoint failed" "$out"
  if grep -q FAILED <<<"$out"; then fail "a good checkpoint FAILED" "$out"; fi
  /usr/bin/python3 - "$ckpt" <<'PY' || fail "cannot damage the file"
import h5py, sys
with h5py.File(sys.argv[1], "r") as f:
    offset = f["/model/0001/attn.c_attn.weight"].id.get_offset()
with open(sys.argv[1], "r+b") as f:
    f.seek(offset + 5)
    b = f.read(1)
    f.seek(offset + 5)
    f.write(bytes([b[0] ^ 0x10]))
PY
  out=$("$mpipe" inspect "$ckpt" --stats 2>&1); rc=$?
  [[ $rc -eq 2 ]] || fail "exit $rc, expected 2" "$out"
  grep -Eq "/model/0001/attn.c_attn.weight .* FAILED \(dataset /model/0001/attn.c_attn.weight fails its checksum" <<<"$out" \
    || fail "the damaged tensor is not marked FAILED" "$out"
  [[ $(grep -c FAILED <<<"$out") -eq 2 ]] || fail "not one FAILED tensor and the closing line" "$out"
  grep -Eq "/model/0001/attn.c_proj.weight .* min .* norm" <<<"$out" || fail "the good tensors have no statistics" "$out"
  grep -q "^stats: FAILED (1 problem)$" <<<"$out" || fail "no closing FAILED line" "$out"
  [[ $(grep -c error <<<"$out") -eq 1 ]] || fail "not one error line" "$out"
  grep -q "mpipe: error: checkpoint damaged: dataset /model/0001/attn.c_attn.weight fails its checksum" <<<"$out" \
    || fail "the error line does not name the dataset" "$out"
  echo "ok: $(grep error <<<"$out")"
  # The training state damaged: the datasets are not read, for the true reason, and exit 2.
  checkpoint
  /usr/bin/python3 - "$ckpt" <<'PY' || fail "cannot damage the training state"
import h5py, sys
with h5py.File(sys.argv[1], "r+") as f:
    f.attrs["optimizer"] = "sgd"
PY
  out=$("$mpipe" inspect "$ckpt" --stats 2>&1); rc=$?
  [[ $rc -eq 2 ]] || fail "damaged state: exit $rc, expected 2" "$out"
  if grep -q "(not read: not one of the model's datasets)" <<<"$out"; then fail "a false reason" "$out"; fi
  grep -q "(not read: no usable layer list to check it against; see below)" <<<"$out" || fail "no true reason" "$out"
  grep -q "mpipe: error: checkpoint damaged: .*fails its checksum" <<<"$out" || fail "no error line" "$out"
  echo "ok: damaged state: $(grep error <<<"$out")"
  ;;
lock-output)
  # An output naming the checkpoint directory's lock, by name or by another name of its inode.
  train() {  # DIR: the command line of a run on it, quoted for bash -c
    printf "'%s' " "$mpipe" train --model gpt --layers 1 --d-model 16 --heads 2 --seq-len 16 --vocab 256 --batch-size 2 \
      --micro-batches 1 --steps 1 --threads 1 --checkpoint-dir "$1"
  }
  lock() { echo "mpipe: error: --$1 '.*' is the lock file of --checkpoint-dir '.*', which keeps a second job out of it; hint"; }
  mkdir "$work/d"
  for option in metrics summary trace; do
    expect 2 "$(lock "$option")" "$(train "$work/d") --$option '$work/d/.mpipe.lock'"
  done
  expect 2 "$(lock metrics)" "$(train "$work/d") --metrics '$work/d/../d/.mpipe.lock'"
  expect 2 "$(lock metrics)" "$(train "$work/new") --metrics '$work/new/.mpipe.lock'"  # a directory to be made
  # A lock left by a job (here: made by hand) and a hard link to it elsewhere.
  echo "host x pid 1" > "$work/d/.mpipe.lock"
  ln "$work/d/.mpipe.lock" "$work/other"
  expect 2 "$(lock metrics)" "$(train "$work/d") --metrics '$work/other'"
  [[ $(cat "$work/d/.mpipe.lock") == "host x pid 1" ]] || fail "the lock was written over"
  # export's OUT: the lock by its name, or by a hard link to it.
  bash -c "$(train "$work/e")" >/dev/null 2>&1 || fail "the run for export failed"
  echo "host x pid 1" > "$work/e/.mpipe.lock"
  ln "$work/e/.mpipe.lock" "$work/e-lock"
  for out in "$work/e/.mpipe.lock" "$work/e-lock"; do
    expect 2 "error: '.*' is a checkpoint directory's lock file, which keeps a second job out of it; hint" \
      "'$mpipe' export '$work/e' '$out'"
  done
  [[ $(cat "$work/e/.mpipe.lock") == "host x pid 1" ]] || fail "export wrote over the lock"
  ;;
minor)
  # --threads above the cores: one warning that says what runs, and the run goes on.
  out=$("$mpipe" train --layers 1 --d-model 16 --heads 2 --seq-len 16 --batch-size 2 --micro-batches 1 --steps 1 \
        --threads 100000 2>&1) || fail "--threads 100000 failed" "$out"
  [[ $(grep -c "warning: --threads 100000 is more than the [0-9]* cores\? rank 0 may use; it runs [0-9]* threads\?" <<<"$out") -eq 1 ]] \
    || fail "not one --threads warning" "$out"
  echo "ok: $(grep warning <<<"$out")"
  # An empty --sample-prompt: a hint about the prompt, not the model.
  expect 2 "error: --sample-every: --sample-prompt is empty; hint: give --sample-prompt one byte or more" \
    "'$mpipe' train --sample-every 1 --sample-prompt ''"
  # --prompt-tokens naming a directory: the true reason, not the stream's.
  checkpoint
  expect 2 "mpipe: error: --prompt-tokens '.*' is a directory; hint" "'$mpipe' generate --checkpoint '$ckpt' --prompt-tokens '$work'"
  # Another program's HDF5 file, and a checkpoint of a newer format: no "older checkpoint" hint.
  /usr/bin/python3 - "$work/foreign.h5" "$ckpt" "$work/newer.h5" <<'PY' || fail "cannot make the files"
import h5py, shutil, sys
with h5py.File(sys.argv[1], "w") as f:
    f["x"] = [1.0, 2.0]
shutil.copy(sys.argv[2], sys.argv[3])
with h5py.File(sys.argv[3], "r+") as f:
    f.attrs["format_version"] = 99
PY
  expect 2 "mpipe: error: '.*foreign.h5' is not an mpipe checkpoint; hint: give a checkpoint file mpipe wrote" \
    "'$mpipe' generate --checkpoint '$work/foreign.h5'"
  expect 2 "mpipe: error: '.*newer.h5' has checkpoint format version 99, newer than this mpipe's .*; hint: use the mpipe that wrote it" \
    "'$mpipe' export '$work/newer.h5' '$work/out.safetensors'"
  ;;
*)
  fail "unknown case $case"
  ;;
esac
