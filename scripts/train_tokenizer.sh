#!/usr/bin/env bash
# Trains a SentencePiece tokenizer on text files with Debian's spm_train (the sentencepiece
# package; scripts/setup.sh installs it), for train --tokenizer, tokenize and generate.
# BPE with byte fallback (Llama 1 and 2's kind: any bytes encode, none is unknown),
# identity normalisation (decode gives back the very text), digits split; one thread and a
# fixed seed, so the same text gives the same file. docs/tokenizers.md says why.
# Usage: scripts/train_tokenizer.sh TEXT... --vocab N --out DIR
# Writes DIR/tokenizer.model (and spm_train's DIR/tokenizer.vocab); prints the model's path.
set -euo pipefail
usage="usage: scripts/train_tokenizer.sh TEXT... --vocab N --out DIR"
die() { echo "train_tokenizer.sh: error: $1; hint: $2" >&2; exit 2; }
inputs=() vocab= out=
while (($#)); do
  case $1 in
    --vocab) (($# >= 2)) || die "--vocab needs a number" "$usage"; vocab=$2; shift 2 ;;
    --out) (($# >= 2)) || die "--out needs a directory" "$usage"; out=$2; shift 2 ;;
    -h|--help) echo "$usage"; exit 0 ;;
    -*) die "unknown option '$1'" "$usage" ;;
    *) inputs+=("$1"); shift ;;
  esac
done
((${#inputs[@]})) || die "no text file given" "$usage"
[[ -n $out ]] || die "--out is required" "$usage"
[[ $vocab =~ ^[0-9]+$ ]] || die "--vocab '$vocab' is not a whole number" "e.g. --vocab 4000"
# byte fallback's 256 byte pieces and the three specials (unk, bos, eos) come first
((vocab >= 300 && vocab <= 1000000)) || die "--vocab $vocab is outside 300 to 1000000" \
  "give room for the 256 byte pieces and the specials, e.g. --vocab 4000"
for f in "${inputs[@]}"; do
  [[ -f $f && -r $f ]] || die "no readable text file '$f'" "give the text to learn from"
  [[ $f != *,* ]] || die "'$f' has a comma in its name, which spm_train's --input splits on" "rename or copy it"
done
command -v spm_train >/dev/null || die "spm_train is missing" "run scripts/setup.sh (or apt-get install sentencepiece)"
mkdir -p "$out" || die "cannot make directory '$out'" "give --out a directory you can write"
log=$(mktemp) && trap 'rm -f "$log"' EXIT
input=$(IFS=,; echo "${inputs[*]}")
# hard_vocab_limit off: a small text (README.md) that cannot fill --vocab gives fewer pieces
# rather than an error; the model's --vocab must be at least the count printed.
if ! spm_train --input="$input" --model_prefix="$out/tokenizer" --vocab_size="$vocab" --model_type=bpe \
     --byte_fallback=true --character_coverage=0.9995 --split_digits=true \
     --normalization_rule_name=identity --remove_extra_whitespaces=false --hard_vocab_limit=false \
     --num_threads=1 --random_seed=1 --input_sentence_size=0 --minloglevel=1 > "$log" 2>&1; then
  tail -5 "$log" >&2
  die "spm_train failed on ${inputs[*]} (its last lines above)" "check the text files and --vocab"
fi
echo "train_tokenizer.sh: $(wc -l < "$out/tokenizer.vocab") tokens learnt from ${inputs[*]}" >&2
echo "$out/tokenizer.model"
