#!/usr/bin/env bash
# Generation speed on one CPU thread: `mpipe generate --temperature 0` against PyTorch's
# greedy loop with a key/value cache (scripts/mpipe_torch.py's GPT2HF.generate_greedy,
# Hugging Face's use_cache) over the same weights (mpipe export), rounds interleaved. The
# model is the quickstart's (4 blocks, 128 channels, 64 tokens of context, 256 bytes),
# trained briefly; each run a prompt of 16 bytes and TOKENS new ones (the window slides
# past the context in both alike), timed from the prompt's forward to the last token.
# Prints a table and the median ratio; exits non-zero if the two texts differ.
#   TOKENS=N (default 512)  ROUNDS=N (default 5)  CONFIG=FILE (default inputs/quickstart.toml)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
[[ -f build/release/CMakeCache.txt ]] || cmake --preset release >/dev/null
cmake --build --preset release --target mpipe >/dev/null
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
tokens=${TOKENS:-512} rounds=${ROUNDS:-5} config=${CONFIG:-inputs/quickstart.toml}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
build/release/mpipe train --config "$config" --steps 100 --log-every 1000 --threads 1 --checkpoint-dir "$work/run" >/dev/null
build/release/mpipe export "$work/run" "$work/gpt.safetensors" >/dev/null
prompt="Once upon a time"

mpipe_run() {  # prints tokens/s; the ids go to $work/mpipe.txt
  build/release/mpipe generate --checkpoint "$work/run" --prompt "$prompt" --tokens "$tokens" --temperature 0 \
    --output ids --threads 1 2>"$work/err" >"$work/mpipe.txt"
  sed -n 's/.* s: \([0-9.]*\) tokens\/s.*/\1/p' "$work/err"
}
torch_run() {  # prints tokens/s; the ids go to $work/torch.txt
  /usr/bin/python3 - "$work/gpt.safetensors" "$config" "$prompt" "$tokens" "$work/torch.txt" <<'PY'
import sys, time, tomllib
import torch
sys.path.insert(0, "scripts")
from mpipe_torch import GPT2HF, read_safetensors
torch.set_num_threads(1)
path, config, prompt, n, out = sys.argv[1], sys.argv[2], sys.argv[3].encode(), int(sys.argv[4]), sys.argv[5]
with open(config, "rb") as f:
    c = tomllib.load(f)
tensors, _ = read_safetensors(path)
model = GPT2HF(c["layers"], c["d-model"], c["heads"], c["seq-len"], c["vocab"])
model.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=True)
model.eval()
model.generate_greedy(list(prompt), 8)  # warm up
start = time.perf_counter()
new = model.generate_greedy(list(prompt), n)
seconds = time.perf_counter() - start
with open(out, "w") as f:
    f.write(" ".join(str(t) for t in [*prompt, *new]) + "\n")
print(f"{n / seconds:.1f}")
PY
}

echo "generation, one CPU thread: $config, prompt of ${#prompt} bytes, $tokens tokens, greedy"
printf '%-6s %16s %16s %8s\n' round "mpipe tok/s" "PyTorch tok/s" ratio
ratios=()
for ((r = 1; r <= rounds; r++)); do
  if ((r % 2)); then m=$(mpipe_run); t=$(torch_run); else t=$(torch_run); m=$(mpipe_run); fi
  ratio=$(awk -v a="$m" -v b="$t" 'BEGIN { printf "%.2f", a / b }')
  ratios+=("$ratio")
  printf '%-6s %16s %16s %7sx\n' "$r" "$m" "$t" "$ratio"
  cmp -s <(tr -s ' \n' ' ' <"$work/mpipe.txt") <(tr -s ' \n' ' ' <"$work/torch.txt") ||
    { echo "FAIL: the greedy texts differ"; exit 1; }
done
median=$(printf '%s\n' "${ratios[@]}" | sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }')
echo "median ratio (mpipe / PyTorch tokens/s): ${median}x; the greedy texts are the same token for token"
