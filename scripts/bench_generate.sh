#!/usr/bin/env bash
# Generation speed on one CPU thread: `mpipe generate --temperature 0` against PyTorch's
# greedy loop with a key/value cache over the same weights, rounds interleaved. Two rows:
# gpt, the quickstart's model (4 blocks, 128 channels, 64 tokens of context, 256 bytes)
# against scripts/mpipe_torch.py's GPT2HF.generate_greedy (Hugging Face's use_cache) over
# what mpipe export wrote; llama, a Llama of the same sizes (4 heads, 2 key/value heads,
# the SwiGLU width Llama's rule gives, 512; its own head) against the reference twin's
# Llama.generate_greedy (rotated keys cached) over the checkpoint's weights, read by name.
# Each trained briefly on the quickstart's data; each run a prompt of 16 bytes and TOKENS
# new ones (the window slides past the context in both alike), timed from the prompt's
# forward to the last token. Prints a table and each row's median ratio; exits non-zero if
# the two texts differ.
#   TOKENS=N (default 512)  ROUNDS=N (default 5)  CONFIG=FILE (default inputs/quickstart.toml)
#   ROWS=REGEX  only the rows whose model matches (gpt, llama; e.g. ROWS=llama)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
[[ -f build/release/CMakeCache.txt ]] || cmake --preset release >/dev/null
cmake --build --preset release --target mpipe >/dev/null
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
tokens=${TOKENS:-512} rounds=${ROUNDS:-5} config=${CONFIG:-inputs/quickstart.toml}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
prompt="Once upon a time"
llama_args=(--model llama --kv-heads 2 --tie-embeddings off)

mpipe_run() {  # MODEL: prints tokens/s; the ids go to $work/mpipe.txt
  build/release/mpipe generate --checkpoint "$work/$1" --prompt "$prompt" --tokens "$tokens" --temperature 0 \
    --output ids --threads 1 2>"$work/err" >"$work/mpipe.txt"
  sed -n 's/.* s: \([0-9.]*\) tokens\/s.*/\1/p' "$work/err"
}
torch_run() {  # MODEL: prints tokens/s; the ids go to $work/torch.txt
  /usr/bin/python3 - "$1" "$work" "$config" "$prompt" "$tokens" <<'PY'
import glob, sys, time, tomllib
import h5py
import torch
sys.path.insert(0, "scripts")
from mpipe_torch import GPT2HF, Llama, read_safetensors
torch.set_num_threads(1)
kind, work, config, prompt, n = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].encode(), int(sys.argv[5])
with open(config, "rb") as f:
    c = tomllib.load(f)
sizes = (c["layers"], c["d-model"], c["heads"], c["seq-len"], c["vocab"])
if kind == "gpt":
    tensors, _ = read_safetensors(f"{work}/gpt.safetensors")
    model = GPT2HF(*sizes)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=True)
else:  # the twin under mpipe's names, from the run's checkpoint
    model = Llama(*sizes, kv_heads=2)
    with h5py.File(sorted(glob.glob(f"{work}/llama/ckpt-*.h5"))[-1], "r") as f, torch.no_grad():
        for (layer, name), p in model.named().items():
            p.copy_(torch.from_numpy(f[f"model/{layer:04d}/{name}"][()]))
model.eval()
model.generate_greedy(list(prompt), 8)  # warm up
start = time.perf_counter()
new = model.generate_greedy(list(prompt), n)
seconds = time.perf_counter() - start
with open(f"{work}/torch.txt", "w") as f:
    f.write(" ".join(str(t) for t in [*prompt, *new]) + "\n")
print(f"{n / seconds:.1f}")
PY
}

echo "generation, one CPU thread: $config's sizes, prompt of ${#prompt} bytes, $tokens tokens, greedy"
printf '%-6s %-6s %16s %16s %8s\n' model round "mpipe tok/s" "PyTorch tok/s" ratio
medians=()
for model in gpt llama; do
  [[ -z ${ROWS:-} || $model =~ $ROWS ]] || continue
  extra=()
  [[ $model == llama ]] && extra=("${llama_args[@]}")
  build/release/mpipe train --config "$config" "${extra[@]}" --steps 100 --log-every 1000 --threads 1 \
    --checkpoint-dir "$work/$model" >/dev/null
  [[ $model == gpt ]] && build/release/mpipe export "$work/gpt" "$work/gpt.safetensors" >/dev/null
  ratios=()
  for ((r = 1; r <= rounds; r++)); do
    if ((r % 2)); then m=$(mpipe_run $model); t=$(torch_run $model); else t=$(torch_run $model); m=$(mpipe_run $model); fi
    ratio=$(awk -v a="$m" -v b="$t" 'BEGIN { printf "%.2f", a / b }')
    ratios+=("$ratio")
    printf '%-6s %-6s %16s %16s %7sx\n' "$model" "$r" "$m" "$t" "$ratio"
    cmp -s <(tr -s ' \n' ' ' <"$work/mpipe.txt") <(tr -s ' \n' ' ' <"$work/torch.txt") ||
      { echo "FAIL: the greedy texts of $model differ"; exit 1; }
  done
  medians+=("$model $(printf '%s\n' "${ratios[@]}" | sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }')")
done
for line in "${medians[@]}"; do
  read -r model median <<<"$line"
  echo "$model: median ratio (mpipe / PyTorch tokens/s): ${median}x; the greedy texts are the same token for token"
done
