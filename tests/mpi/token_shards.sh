#!/usr/bin/env bash
# tokens:PATH under mpiexec with real llm.c shards (tests/cli/make_shards.py writes them):
# a shard directory trains on 2 ranks (windows and documents packing, a held-out shard in
# order); one shard, a directory of that shard and a flat file of the same tokens give the
# same bits (one shard's windows are a flat file's, the rule of every earlier release); a
# shard changed under the run, or an id past the vocabulary, ends it at that step, exit 2,
# one line naming the shard.
# Usage: token_shards.sh MPIPE MAKE_SHARDS_PY
set -euo pipefail
mpipe=$1 make_shards=$2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
work=$(mktemp -d)
# The clean-up keeps the script's status: a job already gone (kill fails) must not turn a pass
# into exit 1 under set -e, as it did once in CI.
trap 'rc=$?; set +e; for j in $(jobs -p); do pkill -9 -P "$j"; kill -9 "$j"; done 2>/dev/null; rm -rf "$work"; exit $rc' EXIT
fail() { echo "FAIL: $*"; exit 1; }
run() { local n=$1; shift; mpiexec -n "$n" --oversubscribe "$mpipe" "$@"; }
/usr/bin/python3 "$make_shards" "$work/s"
gpt=(train --model gpt --layers 2 --d-model 32 --heads 4 --seq-len 16 --vocab 64 --batch-size 8 --micro-batches 2
     --threads 1 --lr 3e-3 --log-every 1 --steps 6)

# A directory of three shards trains on 2 stages, both packings, with a held-out shard.
for packing in windows documents; do
  out=$(run 2 "${gpt[@]}" --data "tokens:$work/s/good" --data-packing $packing --eot-id 0 \
        --eval-data "tokens:$work/s/val.bin" --eval-batches 2 --checkpoint-dir "$work/$packing")
  grep -q "tokens $work/s/good: 3 shards (llm.c GPT-2 shard, uint16), 6[0-9]* tokens" <<<"$out" || fail "$packing: data not described: $out"
  [[ $packing == windows ]] || grep -q "windows at [0-9]* document starts (end-of-text id 0)" <<<"$out" || fail "no document starts: $out"
  held_out="124 windows in order"
  [[ $packing == windows ]] || held_out="windows at [0-9]* document starts (end-of-text id 0), [0-9]* windows in order"
  grep -q "tokens file $work/s/val.bin (llm.c GPT-2 shard, uint16), 2000 tokens, $held_out" <<<"$out" \
    || fail "$packing: held-out shard not described: $out"
  grep -Eq "^step +6/6" <<<"$out" || fail "$packing: no step 6: $out"
  grep -Eiq "eval.*loss" <<<"$out" || fail "$packing: no evaluation: $out"
  echo "$packing: $(grep -E '^step +6/6' <<<"$out" | cut -c1-60)"
done
# The checkpoint keeps the options (resume and inspect --config read them).
config=$("$mpipe" inspect "$work/documents/ckpt-00000006.h5" --config)
grep -q '^data-packing = "documents"$' <<<"$config" && grep -q '^eot-id = 0$' <<<"$config" || fail "options not kept: $config"
h5diff -q "$work/windows/ckpt-00000006.h5" "$work/documents/ckpt-00000006.h5" /model /model >/dev/null 2>&1 \
  && fail "documents packing trained the same bits as windows"

# The same tokens as a flat file, one shard and a directory holding that shard: the same bits.
for spec in flat "one/all.bin" one; do
  dir=$work/bits_${spec//\//_}
  path=$work/s/$spec
  [[ $spec == flat ]] && path=$work/s/flat.bin
  run 2 "${gpt[@]}" --data "tokens:$path" --checkpoint-dir "$dir" >/dev/null
done
for other in "$work/bits_one_all.bin" "$work/bits_one"; do
  h5diff "$work/bits_flat/ckpt-00000006.h5" "$other/ckpt-00000006.h5" /model /model \
    || fail "$other: not the flat file's bits"
done
echo "flat file, one shard and its directory: the same /model"

# A shard rewritten in place under the run: exit 2 at that step, one line naming it.
cp -r "$work/s/good" "$work/live"
run 2 "${gpt[@]}" --steps 100000 --data "tokens:$work/live" > "$work/log" 2>&1 & pid=$!
for _ in $(seq 600); do grep -q "^step  *3/" "$work/log" && break; sleep 0.1; done
grep -q "^step  *3/" "$work/log" || fail "no third step: $(cat "$work/log")"
printf 'x' >> "$work/live/train_001.bin"
( sleep 60; kill -9 "$pid" 2>/dev/null ) & guard=$!
set +e; wait "$pid"; rc=$?; set -e
pkill -P "$guard" sleep 2>/dev/null; kill "$guard" 2>/dev/null || true
[[ $rc -eq 2 ]] || fail "exit $rc after a shard changed: $(tail -5 "$work/log")"
[[ $(grep -c "mpipe: error" "$work/log") -eq 1 ]] || fail "not one error line: $(cat "$work/log")"
grep -Eq "mpipe: error: rank [01] .* at step [0-9]+ reading the batch: data file '$work/live/train_001.bin' changed while training read it \(.*\); hint" \
  "$work/log" || fail "the line does not name the shard: $(grep error "$work/log")"
echo "changed: $(grep "mpipe: error" "$work/log" | cut -c1-140)"

# An id past the model's vocabulary: said by the first stage at the step that reads it.
set +e; out=$(run 2 "${gpt[@]}" --data "tokens:$work/s/vocab.bin" 2>&1); rc=$?; set -e
[[ $rc -eq 2 ]] || fail "exit $rc for an id past the vocabulary: $out"
[[ $(grep -c "mpipe: error" <<<"$out") -eq 1 ]] || fail "not one error line: $out"
grep -Eq "mpipe: error: rank 0 .* at step 0 reading the batch: data file '$work/s/vocab.bin' holds token id 60000 \(token [0-9]+\), outside the model's vocabulary of 64; hint: use --vocab 60001" \
  <<<"$out" || fail "the line does not name the file and the id: $out"
echo "vocabulary: $(grep "mpipe: error" <<<"$out" | cut -c1-140)"
