#!/usr/bin/env bash
# mpipe tokenize end to end, on a SentencePiece model spm_train learns here from docs/*.md:
# the shard header (llm.c's uint16 kind), the same bytes with 1 and 2 threads, shards cut
# at --shard-size holding the same ids in order, standard input, and bad inputs (exit 2,
# one error line naming the file).
# Usage: tokenize_test.sh MPIPE SOURCE_DIR
set -u
mpipe=$1 source=$2
dir=$(mktemp -d) && trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
cat "$source"/docs/*.md > "$dir/corpus.txt"
spm_train --input="$dir/corpus.txt" --model_prefix="$dir/spm" --vocab_size=500 --minloglevel=2 > /dev/null 2>&1 \
  || fail "spm_train (apt-get install sentencepiece)"
tok() { "$mpipe" tokenize --tokenizer "$dir/spm.model" --progress off "$@"; }
header() { od -An -t d4 -N 12 "$1" | tr -s ' ' | sed 's/^ //'; }

tok "$dir/corpus.txt" "$source/README.md" --out "$dir/one" --threads 1 --document-separator $'\n\n' 2> "$dir/log" || fail "tokenize: $(cat "$dir/log")"
grep -q "mpipe: tokenized .* MB/s on 1 thread" "$dir/log" || fail "no summary line: $(cat "$dir/log")"
tok "$dir/corpus.txt" "$source/README.md" --out "$dir/two" --threads 2 --document-separator $'\n\n' 2> /dev/null || fail "tokenize, 2 threads"
cmp "$dir/one/tokens_000000.bin" "$dir/two/tokens_000000.bin" || fail "1 and 2 threads wrote different shards"
read -r magic version count <<< "$(header "$dir/one/tokens_000000.bin")"
size=$(stat -c %s "$dir/one/tokens_000000.bin")
[[ $magic == 20240520 && $version == 1 ]] || fail "header magic $magic version $version"
[[ $size -eq $((1024 + 2 * count)) ]] || fail "header says $count tokens, the file holds $(( (size - 1024) / 2 ))"
[[ $count -gt 1000 ]] || fail "only $count tokens"
# The first token is the end-of-text id (SentencePiece's EOS, 2 by spm_train's defaults).
[[ $(od -An -t u2 -j 1024 -N 2 "$dir/one/tokens_000000.bin" | tr -d ' ') == 2 ]] || fail "the first id is not EOS"

# Small shards: the same ids, cut in order; no .partial left.
tok "$dir/corpus.txt" "$source/README.md" --out "$dir/small" --shard-size 1000 --document-separator $'\n\n' 2> /dev/null || fail "small shards"
shards=$(ls "$dir/small" | wc -l)
[[ $shards -eq $(( (count + 999) / 1000 )) ]] || fail "$shards shards for $count tokens of 1000 a shard"
ls "$dir/small" | grep -q partial && fail "a .partial shard was left"
cmp <(tail -c +1025 "$dir/one/tokens_000000.bin") <(for f in "$dir"/small/tokens_*.bin; do tail -c +1025 "$f"; done) \
  || fail "the small shards' ids are not the one shard's"
# Standard input: the same as the file.
tok - --out "$dir/stdin" < "$dir/corpus.txt" 2> /dev/null || fail "tokenize -"
tok "$dir/corpus.txt" --out "$dir/file" 2> /dev/null || fail "tokenize file"
cmp "$dir/stdin/tokens_000000.bin" "$dir/file/tokens_000000.bin" || fail "standard input differs from the file"

# Bad inputs: exit 2, one line naming the file.
bad() {
  local want=$1; shift
  out=$("$mpipe" tokenize "$@" 2>&1); rc=$?
  [[ $rc -eq 2 ]] || fail "exit $rc, not 2, for: $* ($out)"
  [[ $(grep -c error <<< "$out") -eq 1 ]] || fail "not one error line for: $* ($out)"
  grep -Eq -- "$want" <<< "$out" || fail "'$out' does not match /$want/"
}
bad "error: '$source/inputs/mlp.toml' is not a tokenizer.*; hint" --tokenizer "$source/inputs/mlp.toml" "$dir/corpus.txt" --out "$dir/x"
head -c 3000 /dev/urandom > "$dir/noise.model"
bad "error: '$dir/noise.model' is not a tokenizer" --tokenizer "$dir/noise.model" "$dir/corpus.txt" --out "$dir/x"
echo '{"model": {"type": "WordPiece"}}' > "$dir/wp.json"
bad "error: '$dir/wp.json' is a WordPiece tokenizer.json" --tokenizer "$dir/wp.json" "$dir/corpus.txt" --out "$dir/x"
bad "error: no input file '$dir/absent.txt'" --tokenizer "$dir/spm.model" "$dir/absent.txt" --out "$dir/x"
bad "error: no tokenizer file '$dir/absent.model'" --tokenizer "$dir/absent.model" "$dir/corpus.txt" --out "$dir/x"
bad "error: --eot-id 500 is past the vocabulary of '$dir/spm.model' \(500 tokens\)" --tokenizer "$dir/spm.model" --eot-id 500 "$dir/corpus.txt" --out "$dir/x"
bad "error: --out '$dir/corpus.txt' is not a directory" --tokenizer "$dir/spm.model" "$dir/corpus.txt" --out "$dir/corpus.txt"

# generate --tokenizer: the prompt as words, the continuation decoded; a tokenizer larger
# than the model's vocabulary refused by name.
gpt=(train --model gpt --layers 1 --d-model 16 --heads 2 --seq-len 16 --steps 1 --threads 1 --progress off)
"$mpipe" "${gpt[@]}" --vocab 512 --checkpoint-dir "$dir/run512" > /dev/null 2>&1 || fail "training a 512-token GPT"
"$mpipe" "${gpt[@]}" --vocab 256 --checkpoint-dir "$dir/run256" > /dev/null 2>&1 || fail "training a 256-token GPT"
text=$("$mpipe" generate --checkpoint "$dir/run512" --tokenizer "$dir/spm.model" --prompt "The pipeline stage" --tokens 8 \
       --temperature 0 2> "$dir/log") || fail "generate --tokenizer: $(cat "$dir/log")"
[[ $text == "The pipeline stage"* && ${#text} -gt 18 ]] || fail "generate --tokenizer printed '$text'"
ids=$("$mpipe" generate --checkpoint "$dir/run512" --tokenizer "$dir/spm.model" --prompt "The pipeline stage" --tokens 8 \
      --temperature 0 --output ids 2> /dev/null) || fail "generate --tokenizer --output ids"
[[ $ids =~ ^[0-9]+( [0-9]+)+$ ]] || fail "--output ids printed '$ids'"
out=$("$mpipe" generate --checkpoint "$dir/run256" --tokenizer "$dir/spm.model" --prompt "x" 2>&1); rc=$?
[[ $rc -eq 2 && $(grep -c error <<< "$out") -eq 1 ]] || fail "exit $rc for a tokenizer larger than the model: $out"
grep -q "error: tokenizer '$dir/spm.model' has 500 tokens, more than the model's vocabulary of 256; hint" <<< "$out" \
  || fail "the vocabulary mismatch said: $out"
echo "ok: tokenize ($count tokens, $shards small shards) and generate --tokenizer ('$text')"
