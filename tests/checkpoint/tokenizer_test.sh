#!/usr/bin/env bash
# The tokenizer travels with the run (docs/tokenizers.md): train --tokenizer on text: data
# keeps the file in every checkpoint (written at the step, and by --checkpoint-async's
# thread on 2 ranks), inspect shows it and --verify checks it, generate uses it with no
# --tokenizer, export DIR/ writes it beside config.json (the single-file form does not),
# --init-from DIR ignores it; a resume with another tokenizer, or a tokenizer on a
# checkpoint that had none, is refused; a resume without --tokenizer keeps the checkpoint's.
# The tokenizer is learnt here by scripts/train_tokenizer.sh on README.md.
# Usage: tokenizer_test.sh MPIPE SOURCE_DIR
set -u
mpipe=$1 source=$2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
dir=$(mktemp -d) && trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
expect_error() {  # REGEX command...: exit 2 and one error line matching REGEX
  local regex=$1; shift
  out=$("$@" 2>&1); rc=$?
  [[ $rc -eq 2 ]] || fail "exit $rc, not 2, for: $* ($out)"
  [[ $(grep -c "error:" <<< "$out") -eq 1 ]] || fail "not one error line for: $* ($out)"
  grep -Eq -- "$regex" <<< "$out" || fail "'$out' does not match /$regex/"
}
tok=$("$source/scripts/train_tokenizer.sh" "$source/README.md" --vocab 500 --out "$dir/tok" 2> "$dir/log") \
  || fail "train_tokenizer.sh: $(cat "$dir/log")"
[[ $tok == "$dir/tok/tokenizer.model" && -s $tok ]] || fail "train_tokenizer.sh printed '$tok'"
cp "$tok" "$dir/first.model" && "$source/scripts/train_tokenizer.sh" "$source/README.md" --vocab 500 --out "$dir/tok" > /dev/null 2>&1
cmp "$dir/first.model" "$tok" || fail "train_tokenizer.sh is not reproducible"
"$source/scripts/train_tokenizer.sh" "$source/README.md" --vocab 400 --out "$dir/other" > /dev/null 2>&1 || fail "another tokenizer"

gpt=(--model gpt --layers 2 --d-model 32 --heads 2 --seq-len 32 --vocab 512 --batch-size 4 --micro-batches 2 --threads 1
     --log-every 1 --data "text:$source/README.md")
train() { "$mpipe" train "${gpt[@]}" "$@"; }
train --tokenizer "$tok" --steps 4 --checkpoint-dir "$dir/run" --checkpoint-every 2 > "$dir/log" 2>&1 || fail "train: $(cat "$dir/log")"
# The text is the tokenizer's ids, not its bytes: the data line says so and counts fewer tokens.
grep -Eq "^data: text file .*README.md \(tokenizer: SentencePiece.*\), [0-9]+ tokens" "$dir/log" || fail "the data line: $(grep ^data "$dir/log")"
ids=$(sed -n 's/^data: text file .*), \([0-9]*\) tokens.*/\1/p' "$dir/log")
(( ids > 0 && ids < $(stat -c %s "$source/README.md") * 3 / 4 )) || fail "$ids ids for $(stat -c %s "$source/README.md") bytes of text"
bytes=$(stat -c %s "$tok")
for c in "$dir"/run/ckpt-0000000{2,4}.h5; do
  "$mpipe" inspect --verify "$c" > "$dir/inspect" 2>&1 || fail "inspect --verify $c: $(cat "$dir/inspect")"
  grep -Eq "^  tokenizer +tokenizer.model \(sentencepiece, $bytes bytes, crc32 [0-9a-f]{8}\)$" "$dir/inspect" \
    || fail "no tokenizer line in: $(cat "$dir/inspect")"
done
"$mpipe" inspect --config "$dir/run/ckpt-00000004.h5" | grep -qx "tokenizer = \"$tok\"" || fail "the options lack the tokenizer"

# generate: the checkpoint's tokenizer with no --tokenizer, words in and out; ids as before.
text=$("$mpipe" generate --checkpoint "$dir/run" --prompt "the pipeline" --tokens 8 --temperature 0 2> "$dir/log") \
  || fail "generate: $(cat "$dir/log")"
[[ $text == "the pipeline"* && ${#text} -gt 12 ]] || fail "generate printed '$text'"
ids=$("$mpipe" generate --checkpoint "$dir/run" --prompt "the pipeline" --tokens 8 --temperature 0 --output ids 2> /dev/null) \
  || fail "generate --output ids"
[[ $ids =~ ^[0-9]+( [0-9]+)+$ ]] || fail "generate --output ids printed '$ids'"
same=$("$mpipe" generate --checkpoint "$dir/run" --tokenizer "$tok" --prompt "the pipeline" --tokens 8 --temperature 0 2> /dev/null)
[[ $same == "$text" ]] || fail "--tokenizer with the same file printed '$same', not '$text'"

# export: DIR/ holds tokenizer.model, the file's very bytes; the single-file form writes none.
"$mpipe" export "$dir/run" "$dir/hf/" > "$dir/log" 2>&1 || fail "export: $(cat "$dir/log")"
grep -q "and $dir/hf/tokenizer.model" "$dir/log" || fail "export's line: $(cat "$dir/log")"
cmp "$tok" "$dir/hf/tokenizer.model" || fail "the exported tokenizer.model is not the file trained with"
[[ -f $dir/hf/config.json ]] || fail "no config.json"
mkdir "$dir/single" && "$mpipe" export "$dir/run" "$dir/single/model.safetensors" > /dev/null 2>&1 || fail "export to a file"
[[ $(ls "$dir/single") == model.safetensors ]] || fail "the single-file export wrote $(ls "$dir/single")"
train --tokenizer "$tok" --steps 1 --init-from "$dir/hf" > "$dir/log" 2>&1 || fail "--init-from the export: $(cat "$dir/log")"

# 2 ranks, 2 stages, the checkpoints written by --checkpoint-async's thread: the same tokenizer.
mpiexec -n 2 --oversubscribe "$mpipe" train "${gpt[@]}" --stages 2 --tokenizer "$tok" --steps 4 --checkpoint-dir "$dir/async" \
  --checkpoint-every 2 --checkpoint-async on > "$dir/log" 2>&1 || fail "train on 2 ranks: $(cat "$dir/log")"
for c in "$dir"/async/ckpt-0000000{2,4}.h5; do
  "$mpipe" inspect --verify "$c" > "$dir/inspect" 2>&1 || fail "inspect --verify $c: $(cat "$dir/inspect")"
  grep -q "tokenizer.model (sentencepiece, $bytes bytes" "$dir/inspect" || fail "$c: $(grep tokenizer "$dir/inspect")"
  h5diff "$c" "$dir/run/ckpt-00000004.h5" /tokenizer /tokenizer || fail "$c's tokenizer differs from the 1-rank run's"
done

# Resuming: another tokenizer refused, naming both; none given keeps the checkpoint's.
expect_error "checkpoint '$dir/run/ckpt-00000004.h5' was trained with tokenizer 'tokenizer.model' \(crc32 [0-9a-f]+\); --tokenizer '$dir/other/tokenizer.model' is another file" \
  train --tokenizer "$dir/other/tokenizer.model" --steps 6 --checkpoint-dir "$dir/run"
expect_error "checkpoint '$dir/run/ckpt-00000004.h5' was trained on text encoded by tokenizer 'tokenizer.model'; without --tokenizer this run would read the text's bytes as its ids" \
  train --steps 6 --checkpoint-dir "$dir/run"
train --tokenizer "$tok" --steps 6 --checkpoint-dir "$dir/run" > "$dir/log" 2>&1 || fail "resume, same tokenizer: $(cat "$dir/log")"
grep -q "resumed from" "$dir/log" || fail "did not resume: $(cat "$dir/log")"
h5diff "$dir/run/ckpt-00000006.h5" "$dir/run/ckpt-00000004.h5" /tokenizer /tokenizer || fail "the resumed run dropped the tokenizer"
train --steps 2 --checkpoint-dir "$dir/plain" > /dev/null 2>&1 || fail "train without a tokenizer"
"$mpipe" inspect "$dir/plain/ckpt-00000002.h5" | grep -Eq "^  tokenizer +\(none\)$" || fail "a checkpoint without one"
expect_error "checkpoint '$dir/plain/ckpt-00000002.h5' holds no tokenizer \(its run had none\); --tokenizer '$tok' would change" \
  train --tokenizer "$tok" --steps 4 --checkpoint-dir "$dir/plain"

# Bad input: exit 2, one line naming the file.
expect_error "error: tokenizer '$tok' has 500 tokens, more than the model's vocabulary of 256" \
  "$mpipe" train "${gpt[@]}" --vocab 256 --tokenizer "$tok" --steps 1
expect_error "error: --tokenizer '$tok' turns text into ids, and --data 'tokens:x.bin' is not text: data; hint: tokens: files are already ids" \
  "$mpipe" train "${gpt[@]}" --data tokens:x.bin --tokenizer "$tok" --steps 1
echo "ok: the tokenizer travels ('$text')"
