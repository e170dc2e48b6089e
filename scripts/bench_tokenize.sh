#!/usr/bin/env bash
# Tokenizer throughput: `mpipe tokenize` with SentencePiece models (unigram and BPE) and a
# byte-level BPE tokenizer.json, on one thread (MB/s per core) and on every core, beside
# Debian's python3-sentencepiece encoding the same documents with the same models on one thread.
# The text: docs/*.md and README.md repeated to SIZE_MB (default 50) MB, documents split
# at blank lines. The models are learnt from the docs here: spm_train (unigram and BPE, VOCAB
# pieces, default 2000) and 2000 BPE merges by tests/reference/check_tokenizer.py's trainer.
#   MPIPE=PATH   the binary (default: build/release/mpipe, built with the release preset)
# "mpipe, library encoder" rows: the same binary with MPIPE_SENTENCEPIECE=library, which
# encodes with libsentencepiece's SentencePieceProcessor::Encode (mpipe's encoder before).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z ${MPIPE:-} ]]; then
  [[ -f build/release/CMakeCache.txt ]] || cmake --preset release >/dev/null
  cmake --build --preset release --target mpipe >/dev/null
  MPIPE=build/release/mpipe
fi
size_mb=${SIZE_MB:-50} vocab=${VOCAB:-2000}
dir=$(mktemp -d) && trap 'rm -rf "$dir"' EXIT
cat docs/*.md README.md > "$dir/docs.txt"
/usr/bin/python3 - "$dir" "$size_mb" <<'PY'
import json, os, sys
sys.path.insert(0, "tests/reference")
import check_tokenizer as c
d, size = sys.argv[1], float(sys.argv[2])
text = open(os.path.join(d, "docs.txt"), encoding="utf-8").read()
with open(os.path.join(d, "corpus.txt"), "w", encoding="utf-8") as f:
    f.write(text * (int(size * 1e6 / len(text.encode())) + 1))
merges = c.learn_merges(text, c.GPT2_PATTERN, 2000)
ref = c.ReferenceBpe(merges, c.GPT2_PATTERN, False)
json.dump(ref.tokenizer_json(merges, False), open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8"), ensure_ascii=False)
PY
spm_train --input="$dir/docs.txt" --model_prefix="$dir/spm" --vocab_size="$vocab" --minloglevel=2 >/dev/null 2>&1
spm_train --input="$dir/docs.txt" --model_prefix="$dir/spm-bpe" --model_type=bpe --vocab_size="$vocab" \
  --minloglevel=2 >/dev/null 2>&1
mb=$(stat -c %s "$dir/corpus.txt" | awk '{printf "%.1f", $1 / 1e6}')
cores=$(nproc)

# Wall seconds and MB/s from mpipe tokenize's own summary line ("... in S s: R MB/s on T
# threads"); CPU seconds (user + system) of the whole process from GNU time.
run_mpipe() {  # tokenizer threads [MPIPE_SENTENCEPIECE value: "library" for the library's encoder]
  MPIPE_SENTENCEPIECE=${3:-} /usr/bin/time -f "cpu %U %S" "$MPIPE" tokenize --tokenizer "$1" --threads "$2" --progress off \
    --document-separator $'\n\n' "$dir/corpus.txt" --out "$dir/shards" 2> "$dir/log"
  wall=$(sed -n 's/.* in \([0-9.]*\) s: \([0-9.]*\) MB\/s.*/\1 \2/p' "$dir/log")
  echo "$wall $(awk '/^cpu/ {printf "%.2f", $2 + $3}' "$dir/log")"
}
python_sp() {  # model
  /usr/bin/python3 - "$1" "$dir/corpus.txt" <<'PY'
import sys, time
import sentencepiece as spm
sp = spm.SentencePieceProcessor(model_file=sys.argv[1])
data = open(sys.argv[2], encoding="utf-8").read()
documents = [d for d in data.split("\n\n") if d]
start = time.perf_counter()
time.process_time()
for d in documents:
    sp.encode(d)
seconds = time.perf_counter() - start
cpu = time.process_time()  # the process's CPU seconds (reading and splitting included)
print(f"{seconds:.2f} {len(data.encode()) / 1e6 / seconds:.1f} {cpu:.2f}")
PY
}

printf '%s MB of text (docs/*.md + README.md repeated), documents split at blank lines, %s cores (%s)\n' \
  "$mb" "$cores" "$(lscpu | sed -n 's/^Model name: *//p')"
# MB/s per core: MB over wall seconds over threads; MB per CPU second: what a core gives
# when other processes share the machine (the wall figures then fall, these do not).
printf 'wall seconds and MB/s from the run; CPU seconds of the whole process (reading and writing included)\n'
printf '%-30s %-22s %7s %8s %8s %13s %8s %14s\n' tokenizer encoder threads seconds "MB/s" "MB/s per core" "CPU s" "MB per CPU s"
row() {  # tokenizer encoder threads "seconds rate cpu"
  read -r seconds rate cpu <<< "$4"
  printf '%-30s %-22s %7s %8s %8s %13s %8s %14s\n' "$1" "$2" "$3" "$seconds" "$rate" \
    "$(awk -v r="$rate" -v t="$3" 'BEGIN{printf "%.1f", r / t}')" "$cpu" "$(awk -v m="$mb" -v c="$cpu" 'BEGIN{printf "%.1f", m / c}')"
}
row "SentencePiece unigram $vocab" "mpipe tokenize" 1 "$(run_mpipe "$dir/spm.model" 1)"
row "SentencePiece unigram $vocab" "python3-sentencepiece" 1 "$(python_sp "$dir/spm.model")"
row "SentencePiece unigram $vocab" "mpipe, library encoder" 1 "$(run_mpipe "$dir/spm.model" 1 library)"
row "SentencePiece unigram $vocab" "mpipe tokenize" "$cores" "$(run_mpipe "$dir/spm.model" "$cores")"
row "SentencePiece BPE $vocab" "mpipe tokenize" 1 "$(run_mpipe "$dir/spm-bpe.model" 1)"
row "SentencePiece BPE $vocab" "python3-sentencepiece" 1 "$(python_sp "$dir/spm-bpe.model")"
row "SentencePiece BPE $vocab" "mpipe, library encoder" 1 "$(run_mpipe "$dir/spm-bpe.model" 1 library)"
row "byte-level BPE, 2000 merges" "mpipe tokenize" 1 "$(run_mpipe "$dir/tokenizer.json" 1)"
row "byte-level BPE, 2000 merges" "mpipe tokenize" "$cores" "$(run_mpipe "$dir/tokenizer.json" "$cores")"
