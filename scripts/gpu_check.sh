#!/usr/bin/env bash
# One command for a machine with a GPU: checks mpipe's CUDA backend and measures it beside
# PyTorch on the same GPU, printing ONE Markdown report (to standard output as each section
# completes, and to --out). Every step runs under `timeout` (its own cap, or what is left of
# --budget, 540 s, when less; a step with under 20 s left is skipped and said so), so with a
# prebuilt build/release the whole ends within 10 minutes; the time each step took is in
# the report. Sections:
#   1. the `cuda` tests (ctest -L cuda): passed / failed / skipped, the failing names;
#   2. a 2-rank pipeline on one GPU in bf16: a GPT (tokens/s) and a ResNet-18 (images/s);
#   3. build/release/tests/bench_gpu: bf16 GEMM rate, each op of a GPT-2-medium block as a
#      fraction of it, a whole step's MFU (its tables as they are);
#   4. PyTorch on the same GPU (python3 with torch and CUDA; scripts/torch_gpu_bench.py):
#      a. GPT-2 medium (24 blocks, C 1024, T 1024, V 50257, 16 heads, batch 8), eager and
#         torch.compile, against mpipe's same model on one rank: tokens/s, peak memory;
#      b. ResNet-50 at 224x224, batch 64, channels_last, eager, against mpipe's (NCHW and
#         --channels-last on): images/s;
#      c. (run right after a, before b) GPT-2 medium's batch of 8 as M = 8 micro-batches on
#         one rank, mpipe against its own M = 1 and PyTorch's gradient accumulation over the
#         same 8 pieces, and mpipe's M = 8 again with --cuda-graphs on (no torch.compile of ResNet-50 yet: its compilation would take the
#         ladder's time);
#      d. (after b) a Llama: Llama-3.2-1B's block shape (C 2048, 32 heads, 8 key/value heads,
#         SwiGLU 8192, RMSNorm, RoPE) cut to 8 blocks, T 1024, V 32000, batch 8, eager and
#         torch.compile, against mpipe's --model llama of the same shape: tokens/s, memory;
#   2b. generation: a GPT-2-small-shaped checkpoint (one step), `mpipe generate --device cuda`
#      in fp32 and bf16 against PyTorch's KV-cache loop over its export: tokens/s, greedy ids;
#   (4a, 4b, 4c with each mpipe run's last step timed by kind of op: --profile-ops)
#   5. with 16 cores or more: scripts/scaling_check.sh (the CPU K ladder, K = 1, 2, 4, 8 at
#      M = 32, on the 8 x 256 GPT and a deep 32 x 128 one, with the contention baseline and
#      where the time goes at K = 8), K = 8 over K = 1 against 6.0x; then scripts/bench_unet.sh
#      (the U-Net at K = 2, its skips across the cut, against 0.9x the GPipe bound);
#   6. on the budget left: ResNet-50 under torch.compile, against mpipe's 4b;
# then the targets (issue 46: GPT >= 1.0x compile, MFU >= 50%, attention forward >= 50% and
# backward >= 40% of the GEMM rate, M = 8 >= 0.85x M = 1 and >= 1.0x PyTorch's accumulation,
# ResNet-50 >= 1.3x eager and >= 1.0x compile, peak memory <= eager's; issue 47: K = 8 >= 6.0x)
# beside what was measured, and every step's exit code and seconds. A step that fails is
# reported (exit code, last lines of its log) and the next one runs.
# Without a GPU (no nvidia-smi, no device, or a build without the CUDA backend:
# build/release/tests/cuda_tests missing or exiting 77) the report says that nothing was
# measured and why, and the exit code is 0. Otherwise the exit code is 1 when a step failed.
# Never installs or rebuilds anything unless build/release/mpipe is missing or --build is
# given (then cmake builds mpipe, cuda_tests and bench_gpu first, outside the budget).
#
# Usage: scripts/gpu_check.sh [--out FILE] [--logs DIR] [--budget SECONDS] [--build]
#                             [--ladder | --no-ladder] [--no-compile]
#   --out     the report (default build/gpu-check-report.md)
#   --logs    every step's full output and JSON (default: the report's name, -logs)
#   --budget  seconds for all the steps (default 540)
#   --ladder / --no-ladder   run the CPU K ladder whatever the cores / never
#   --no-compile  skip PyTorch's torch.compile run (its compilation alone can take minutes
#             of a short lease); mpipe is then compared with eager only
# Environment: PYTHON  the python3 with torch (default: python3, then /usr/bin/python3).
set -uo pipefail
called_from=$PWD  # --out and --logs are paths as the caller typed them, from here
cd "$(dirname "$0")/.." || exit 2

out=""
logs=""
budget=540
build=0
ladder=auto
compile=1
# value OPTION [VALUE]: an option that takes a value has one
value() { [[ $# -ge 2 && -n $2 && $2 != --* ]] || { echo "gpu_check.sh: $1 needs a value (see --help)" >&2; exit 2; }; }
while [[ $# -gt 0 ]]; do
  case $1 in
    --out) value "$@"; out=$2; shift 2 ;;
    --logs) value "$@"; logs=$2; shift 2 ;;
    --budget) value "$@"; budget=$2; shift 2 ;;
    --build) build=1; shift ;;
    --ladder) ladder=1; shift ;;
    --no-ladder) ladder=0; shift ;;
    --no-compile) compile=0; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ $budget =~ ^[0-9]+$ ]] || { echo "gpu_check.sh: --budget takes seconds, got '$budget'" >&2; exit 2; }
if [[ -z $out ]]; then out=build/gpu-check-report.md; elif [[ $out != /* ]]; then out=$called_from/$out; fi
[[ -z $logs || $logs == /* ]] || logs=$called_from/$logs
[[ -n $logs ]] || logs=${out%.md}-logs
# The report is written afresh, so never over anything but an earlier report (a checkpoint
# or a model file given by mistake), nor to a device, a directory or a dangling link.
refuse() { echo "gpu_check.sh: $1; hint: $2" >&2; exit 2; }
if [[ -e $out || -L $out ]]; then
  [[ -f $out ]] || refuse "--out '$out' is not a regular file" "give the path of a report to write, e.g. --out build/gpu.md"
  [[ ! -s $out || $(head -c 17 "$out" | tr -d '\0') == "# mpipe GPU check" ]] ||
    refuse "--out '$out' exists and is not a gpu_check report" "give a new name, or remove the file first"
fi
[[ ! -e $logs || -d $logs ]] || refuse "--logs '$logs' exists and is not a directory" "give --logs DIR"
mkdir -p "$(dirname "$out")" || refuse "cannot create the directory of --out '$out'" "give a writable path"
mkdir -p "$logs" || refuse "cannot create --logs '$logs'" "give a writable directory"
: > "$out" || refuse "cannot write --out '$out'" "give a writable path"

cores=$(nproc)  # before OMP_NUM_THREADS=1 below, which nproc would report instead
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export PYTHONUNBUFFERED=1
mpirun=(mpirun --oversubscribe)
# mpipe on the GPU: ranks unbound, so that each takes the node's cores / its ranks (--threads 0)
# for reading its next batch during the step (--prefetch auto), as a GPU job gets cores
# (srun --cpus-per-task); bound to one core, reading 224x224 images alone takes longer than
# ResNet-50's step on an H100.
gpu_mpirun=(mpirun --oversubscribe --bind-to none)
py=$(command -v python3 || echo /usr/bin/python3)  # any python3: JSON and log parsing
mpipe=build/release/mpipe

# ---- report helpers --------------------------------------------------------------------
say() { printf '%s\n' "$@" | tee -a "$out"; }
# code FILE [LINES]: the file's last LINES (all when 0) as a code block
code() {
  say '```'
  if [[ ${2:-0} == 0 ]]; then tee -a "$out" < "$1"; else tail -n "$2" "$1" | tee -a "$out"; fi
  say '```'
}

failed=0
step_rows=()
deadline=0
# step NAME CAP LOG COMMAND...: COMMAND under `timeout` (CAP seconds, or what is left of the
# budget when less), its output in LOG. Sets step_rc (0 ok; -1 skipped: no time left; with
# skip_rc=N in its environment, exit N is a skip, not a failure) and step_status (words for
# the report); records a row for the steps table.
step() {
  local name=$1 cap=$2 log=$3 left t t0
  shift 3
  left=$((deadline - SECONDS))
  t=$((cap < left ? cap : left))
  if ((t < 20)); then
    step_rc=-1 step_status="skipped: the time budget (--budget ${budget}s) is spent"
    : > "$log"
    step_rows+=("| $name | skipped (no time left) | 0 |")
    return
  fi
  t0=$SECONDS
  timeout -k 15 "$t" "$@" > "$log" 2>&1
  step_rc=$?
  local s=$((SECONDS - t0))
  if ((step_rc == 0)); then
    step_status="ok"
  elif ((step_rc == ${skip_rc:-0})); then
    step_status="skipped (exit $step_rc)"
  elif ((step_rc == 124 || step_rc == 137)); then
    step_status="timed out after ${t} s (exit $step_rc)"
    failed=1
  else
    step_status="failed (exit $step_rc)"
    failed=1
  fi
  step_rows+=("| $name | ${step_status} | $s |")
}
# failure LOG: the step's status and the last lines of its log
failure() {
  say "" "**${name_of_step:-step} ${step_status}**; the last lines of \`$1\`:"
  code "$1" 20
}
# json FILE EXPR: EXPR evaluated on the JSON object s in FILE ('' when absent or wrong)
json() {
  "$py" - "$1" "$2" <<'PY' 2>/dev/null
import json, sys
try:
    s = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
    v = eval(sys.argv[2], {"s": s})
    print("" if v is None else v)
except Exception:
    print("")
PY
}
# calc EXPR: a Python expression, printed (an f-string formats a number)
calc() { "$py" -c "import sys; print($1)" 2>/dev/null; }

# GPU memory in use on the check's GPU every 100 ms while a step runs: the step's peak is the
# highest reading minus the first (taken as the step starts), in MiB.
watch_pid=""
mem_watch() {
  watch_file=$1
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi -i "$gpu" --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$watch_file" 2>/dev/null &
    watch_pid=$!
    sleep 0.3
  else
    : > "$watch_file"
  fi
}
mem_unwatch() {  # sets smi_peak (MiB; empty when not read)
  if [[ -n $watch_pid ]]; then kill "$watch_pid" 2>/dev/null; wait "$watch_pid" 2>/dev/null; fi
  watch_pid=""
  smi_peak=$(awk '$1 ~ /^[0-9]+$/ { if (n++ == 0) base = $1; if ($1 > peak) peak = $1 } END { if (n > 1) printf "%d", peak - base }' \
    "$watch_file")
}
trap '[[ -n $watch_pid ]] && kill "$watch_pid" 2>/dev/null' EXIT

gib() { [[ -n $1 ]] && calc "f'{$1 / 2**30:.2f} GiB'" || echo "n/a"; }
mib_gib() { [[ -n $1 ]] && calc "f'{$1 / 1024:.2f} GiB'" || echo "n/a"; }

# ---- header and the no-GPU exit -----------------------------------------------------------
version=$([[ -x $mpipe ]] && "$mpipe" --version 2>/dev/null | head -1)
say "# mpipe GPU check" "" \
    "$(date -u '+%Y-%m-%d %H:%M UTC') on $(uname -n), $cores cores; ${version:-build/release/mpipe not built yet}"

# nothing WHY [EXIT]: the report's end when nothing can be measured (exit 0: not an error)
nothing() {
  say "" "**Nothing was measured**: $1." "" \
      "(scripts/gpu_check.sh measures on a machine with an NVIDIA GPU and a build with the CUDA backend;" \
      "report: $out)"
  exit "${2:-0}"
}
gpu=0
if [[ -v CUDA_VISIBLE_DEVICES ]]; then
  [[ -z ${CUDA_VISIBLE_DEVICES%%,*} ]] && nothing "CUDA_VISIBLE_DEVICES is set and empty: no GPU is visible"
  [[ ${CUDA_VISIBLE_DEVICES%%,*} =~ ^[0-9]+$ ]] && gpu=${CUDA_VISIBLE_DEVICES%%,*}
fi
export CUDA_VISIBLE_DEVICES=$gpu  # every step on the same one GPU
command -v nvidia-smi > /dev/null || nothing "no NVIDIA driver here (nvidia-smi not found)"
smi=$(timeout 30 nvidia-smi -i "$gpu" --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)
[[ $? -eq 0 && -n $smi ]] || nothing "nvidia-smi finds no GPU $gpu: $(head -1 <<< "$smi")"
say "GPU $gpu: $smi (nvidia-smi)"

if [[ $build == 1 || ! -x $mpipe ]]; then
  why_build="build/release/mpipe is missing"
  [[ $build == 1 ]] && why_build="--build"
  say "" "Building ($why_build; not counted in the budget): cmake --build --preset release --target mpipe cuda_tests bench_gpu"
  {
    { [[ -f build/release/CMakeCache.txt ]] || cmake --preset release; } &&
      cmake --build --preset release --target mpipe &&
      { ! cmake --build --preset release --target help | grep -q cuda_tests ||  # a build with the CUDA backend
          cmake --build --preset release --target cuda_tests bench_gpu; }
  } > "$logs/build.log" 2>&1
  build_rc=$?
  if ((build_rc != 0)) || [[ ! -x $mpipe ]]; then
    say "the build failed (exit $build_rc); the last lines of \`$logs/build.log\`:"
    code "$logs/build.log" 15
    nothing "the build failed" 1
  fi
  say "built: $("$mpipe" --version | head -1)"
fi
[[ -x build/release/tests/cuda_tests ]] ||
  nothing "this build has no CUDA backend (build/release/tests/cuda_tests is missing: nvcc was not found when cmake configured build/release)"
deadline=$((SECONDS + budget))  # from here on, everything counts
timeout 60 build/release/tests/cuda_tests -tc=gpu-check-matches-no-test > "$logs/probe.log" 2>&1
probe=$?
if ((probe == 77)); then
  nothing "the GPU is not usable by this build: $(grep -m1 SKIPPED "$logs/probe.log")"
elif ((probe != 0)); then
  say "" "(cuda_tests' probe exited $probe: $(tail -1 "$logs/probe.log"); going on)"
fi

# PyTorch with CUDA: $PYTHON, python3, /usr/bin/python3, the first that has both
torch_py="" torch_why="no python3 with PyTorch"
for cand in ${PYTHON:-} python3 /usr/bin/python3; do
  command -v "$cand" > /dev/null || continue
  v=$(timeout 120 "$cand" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda, torch.cuda.is_available())' 2>/dev/null | tail -1)
  [[ -n $v ]] || continue
  if [[ $v == *True ]]; then torch_py=$cand torch_v=${v% True}; break; fi
  torch_why="$cand has PyTorch ${v% *} but torch.cuda.is_available() is False"
done
torch_line="none ($torch_why)"
[[ -n $torch_py ]] && torch_line="$torch_py, $torch_v"
say "PyTorch: $torch_line" \
    "Budget: ${budget} s for the steps; logs in \`$logs/\`."

# Values the targets table reads; empty when not measured.
mfu="" mr_rc=-1 m_ips="" att_f="" att_b="" gpt_compile_ratio="" gpt_eager_ratio="" resnet_ratio="" ladder_speedup="" deep_speedup=""
llama_eager_ratio="" llama_compile_ratio="" llama_mem=""
micro_ratio="" micro_torch_ratio="" graphs_ratio="" graphs_micro_ratio=""
deep_machine="" deep_k4="" unet_of_bound="" unet_row=""
gpt_mem="" gpt_mem_ok="" resnet_mem="" resnet_mem_ok=""

# ---- 1. cuda tests -------------------------------------------------------------------------
say "" "## 1. CUDA tests"
name_of_step="cuda tests"
if command -v ctest > /dev/null; then
  step "ctest -L cuda" 180 "$logs/ctest.log" ctest --test-dir build/release -L cuda --output-on-failure
  how="\`ctest --test-dir build/release -L cuda --output-on-failure\`"
else  # the two tests as tests/CMakeLists.txt declares them, their results in ctest's words
  how="cuda_tests run as ctest would (ctest not found)"
  all_rc=0
  : > "$logs/ctest.log"
  for t in ops train; do
    cmd=(build/release/tests/cuda_tests '-tc=cuda op:*')
    [[ $t == train ]] && cmd=("${mpirun[@]}" -n 2 build/release/tests/cuda_tests '-tc=*training*,*transparency*')
    skip_rc=77 step "cuda.$t" 180 "$logs/cuda-$t.log" "${cmd[@]}"
    case $step_rc in
      0) r=Passed ;;
      77) r='***Skipped' ;;
      -1) r='***Not Run' ;;
      *) r='***Failed' all_rc=$step_rc ;;
    esac
    { cat "$logs/cuda-$t.log"; echo "Test #0: cuda.$t ....... $r"; } >> "$logs/ctest.log"
  done
  step_rc=$all_rc step_status=ok
  ((all_rc != 0)) && step_status="failed (exit $all_rc)"
fi
read -r passed failed_n skipped total failing skipping < <("$py" - "$logs/ctest.log" <<'PY'
import re, sys
res = {}
for m in re.finditer(r"Test\s+#\d+: (\S+) \.*\s*(?:\*\*\*)?(Passed|Failed|Skipped|Timeout|Exception|Not Run)", open(sys.argv[1], errors="replace").read()):
    res[m.group(1)] = m.group(2)
p = sum(v == "Passed" for v in res.values()); s = sum(v in ("Skipped", "Not Run") for v in res.values())
bad = [k for k, v in res.items() if v not in ("Passed", "Skipped", "Not Run")]
skip = [k for k, v in res.items() if v in ("Skipped", "Not Run")]
print(p, len(bad), s, len(res), ",".join(bad) or "-", ",".join(skip) or "-")
PY
)
say "$how: $step_status" "" "| passed | failed | skipped | total |" "|---|---|---|---|" \
    "| ${passed:-?} | ${failed_n:-?} | ${skipped:-?} | ${total:-?} |"
[[ ${failing:--} != - ]] && say "" "Failing: ${failing//,/, }"
if ((step_rc > 0)); then
  failure "$logs/ctest.log"
  [[ ${total:-0} == 0 ]] && say "(no test result could be read from the log)"
fi
[[ ${skipping:--} != - ]] && say "" "Skipped: ${skipping//,/, } (a cuda test skips when it finds no usable GPU)"

# ---- 2. 2-rank pipeline on one GPU ----------------------------------------------------------
say "" "## 2. Two-stage pipeline on one GPU, bf16" ""
pipe_rows=()
pipe_run() {  # pipe_run NAME SUMMARY-KEY UNIT LOGNAME MPIPE-ARGS...
  local name=$1 key=$2 unit=$3 base=$4
  shift 4
  rm -f "$logs/$base.json"
  step "$name" 120 "$logs/$base.log" "${gpu_mpirun[@]}" -n 2 "$mpipe" train --device cuda --precision bf16 --steps 10 \
    --log-every 5 --progress off --resume never --summary "$logs/$base.json" "$@"
  if ((step_rc == 0)); then
    local rate
    rate=$(json "$logs/$base.json" "f\"{s['$key']:.0f}\"")
    pipe_rows+=("| $name | ${rate:-?} $unit | $(json "$logs/$base.json" "f\"{1e3 * s['step_time_s']:.1f}\"") ms | $(json "$logs/$base.json" "f\"{100 * s['bubble_fraction']:.1f}%\"") | $(json "$logs/$base.json" "' / '.join(f'{b / 2**20:.0f}' for b in s['peak_activation_bytes_per_rank']) + ' MiB'") |")
  else
    pipe_rows+=("| $name | $step_status | | | |")
  fi
}
pipe_run "GPT 4 x 512, T 512, V 8192, batch 16, M 4" tokens_per_s tokens/s pipe-gpt \
  --layers 4 --d-model 512 --heads 8 --seq-len 512 --vocab 8192 --batch-size 16 --micro-batches 4
gpt_status=$step_status gpt_rc=$step_rc
pipe_run "ResNet-18 64x64, width 32, 10 classes, batch 64, M 4" samples_per_s images/s pipe-resnet \
  --model resnet --layers 18 --image 64 --width 32 --classes 10 --batch-size 64 --micro-batches 4
resnet_status=$step_status resnet_rc=$step_rc
say "\`mpirun -n 2 build/release/mpipe train --device cuda --precision bf16 --steps 10 ...\`; rates from" \
    "\`--summary\` (median step, the first excluded)." "" \
    "| run | throughput | median step | bubble | peak activations rank 0 / 1 |" "|---|---|---|---|---|"
for r in "${pipe_rows[@]}"; do say "$r"; done
dev_line=$(cat "$logs/pipe-gpt.log" "$logs/pipe-resnet.log" 2>/dev/null | grep -m1 '^device:')
[[ -n $dev_line ]] && say "" "\`$dev_line\`"
step_status=$gpt_status step_rc=$gpt_rc
((gpt_rc > 0)) && name_of_step="GPT pipeline" failure "$logs/pipe-gpt.log"
step_status=$resnet_status step_rc=$resnet_rc
((resnet_rc > 0)) && name_of_step="ResNet pipeline" failure "$logs/pipe-resnet.log"

# ---- 2b. generation --------------------------------------------------------------------------
say "" "## 2b. Generation on one GPU (GPT-2 small's shape, one step trained)" ""
name_of_step="generation"
gen=$logs/generate
rm -rf "$gen"; mkdir -p "$gen"
gen_rows=() gen_tps=""
step "generate: a checkpoint" 120 "$gen/train.log" "${gpu_mpirun[@]}" -n 1 "$mpipe" train --device cuda --precision bf16 \
  --layers 12 --d-model 768 --heads 12 --seq-len 1024 --vocab 50257 --batch-size 1 --micro-batches 1 --steps 1 \
  --progress off --resume never --checkpoint-dir "$gen/run"
((step_rc == 0)) && step "generate: export" 60 "$gen/export.log" "$mpipe" export "$gen/run" "$gen/gpt.safetensors"
if ((step_rc == 0)); then
  "$py" -c "import sys; open(sys.argv[1], 'wb').write(bytes(range(32)))" "$gen/prompt.bin"  # 16 uint16 ids
  for precision in fp32 bf16; do
    step "generate: mpipe $precision" 60 "$gen/mpipe-$precision.log" "${gpu_mpirun[@]}" -n 1 "$mpipe" generate --device cuda \
      --precision "$precision" --checkpoint "$gen/run" --prompt-tokens "$gen/prompt.bin" --tokens 256 --temperature 0
    rate=$(sed -n 's/.* s: \([0-9.]*\) tokens\/s.*/\1/p' "$gen/mpipe-$precision.log")
    [[ $precision == fp32 ]] && gen_tps=$rate
    grep -E '^[0-9]+( [0-9]+)*$' "$gen/mpipe-$precision.log" > "$gen/mpipe-$precision.ids"
    gen_rows+=("| mpipe generate, $precision | ${rate:-$step_status} |")
  done
  if [[ -n $torch_py ]]; then
    step "generate: PyTorch fp32" 120 "$gen/torch.log" "$torch_py" - "$gen/gpt.safetensors" "$gen/torch.ids" <<'PY'
import sys, time
import torch
sys.path.insert(0, "scripts")
from mpipe_torch import GPT2HF, read_safetensors
tensors, _ = read_safetensors(sys.argv[1])
model = GPT2HF(12, 768, 12, 1024, 50257)
model.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=True)
model = model.cuda().eval()
prompt = [int.from_bytes(bytes([i, i + 1]), "little") for i in range(0, 32, 2)]  # prompt.bin's ids
model.generate_greedy(prompt, 8)
torch.cuda.synchronize()
start = time.perf_counter()
new = model.generate_greedy(prompt, 256)
torch.cuda.synchronize()
print(f"{256 / (time.perf_counter() - start):.1f} tokens/s")
open(sys.argv[2], "w").write(" ".join(map(str, prompt + new)) + "\n")
PY
    torch_rate=$(sed -n 's/^\([0-9.]*\) tokens\/s$/\1/p' "$gen/torch.log")
    gen_rows+=("| PyTorch's KV-cache loop (GPT2HF.generate_greedy), fp32 | ${torch_rate:-$step_status} |")
    if [[ -n $torch_rate && -n $gen_tps ]]; then
      same=$(cmp -s "$gen/mpipe-fp32.ids" "$gen/torch.ids" && echo "the same" || echo "not the same")
      gen_rows+=("| mpipe fp32 / PyTorch | $(calc "f'{$gen_tps / $torch_rate:.2f}x'"); greedy ids $same |")
    fi
  fi
fi
say "One process, a prompt of 16 ids, 256 new tokens, greedy; tokens/s from \`mpipe generate\`'s last line." "" \
    "| run | tokens/s |" "|---|---|"
for r in "${gen_rows[@]}"; do say "$r"; done

# ---- 3. bench_gpu ------------------------------------------------------------------------
say "" "## 3. bench_gpu: per-op rates and MFU (GPT-2-medium block, bf16)" ""
name_of_step="bench_gpu"
if [[ -x build/release/tests/bench_gpu ]]; then
  # MPIPE_ATTENTION=verbose: which engine each attention shape took (cuDNN's engine, or
  # why cuDNN declined or disagreed), said once per shape on stderr, into the report.
  skip_rc=77 step "bench_gpu" 150 "$logs/bench_gpu.log" env MPIPE_ATTENTION=verbose build/release/tests/bench_gpu
  if ((step_rc == 0)); then
    grep -E '^(\||GPU:|measured|$)' "$logs/bench_gpu.log" | cat -s > "$logs/bench_gpu.md"  # its Markdown, no MPI chatter
    tee -a "$out" < "$logs/bench_gpu.md"
    if grep -q '^mpipe attention' "$logs/bench_gpu.log"; then
      say "" "Attention engines (MPIPE_ATTENTION=verbose):" '```'
      grep '^mpipe attention' "$logs/bench_gpu.log" | sort -u | tee -a "$out"
      say '```'
    fi
    of_gemm() { awk -F'|' -v op="$1" '$2 ~ op { gsub(/[ %]/, "", $5); print $5; exit }' "$logs/bench_gpu.log"; }
    att_f=$(of_gemm "attention forward")
    att_b=$(of_gemm "attention backward")
    mfu=$(awk -F'|' '$2 ~ /MFU/ { gsub(/[ %]/, "", $3); print $3; exit }' "$logs/bench_gpu.log")
  else
    failure "$logs/bench_gpu.log"
  fi
else
  say "build/release/tests/bench_gpu is not built."
  step_rows+=("| bench_gpu | not built | 0 |")
fi

# ---- 4. PyTorch side by side ---------------------------------------------------------------
say "" "## 4. PyTorch side by side on the same GPU"
# torch_run NAME LOGNAME ARGS...: scripts/torch_gpu_bench.py, its GPU memory watched
torch_run() {
  local name=$1 base=$2
  shift 2
  rm -f "$logs/$base.json"
  mem_watch "$logs/$base.mem"
  step "$name" "$cap" "$logs/$base.log" "$torch_py" scripts/torch_gpu_bench.py "$@" --json "$logs/$base.json"
  mem_unwatch
}
# mpipe_run NAME LOGNAME ARGS...: one rank, its GPU memory watched
mpipe_run() {
  local name=$1 base=$2
  shift 2
  rm -f "$logs/$base.json"
  mem_watch "$logs/$base.mem"
  step "$name" "$cap" "$logs/$base.log" "${gpu_mpirun[@]}" -n 1 "$mpipe" train --device cuda --precision bf16 --steps 12 \
    --log-every 4 --progress off --resume never --summary "$logs/$base.json" --profile-ops 12 "$@"
  mem_unwatch
}
# op_table LOG WHAT: the last step's GPU time by kind of op (--profile-ops 12: CUDA events
# around each op; the median step above excludes nothing for it, one step in 11 is slower)
op_table() {
  grep -q '^ops of step' "$1" || return 0
  say "" "$2, its last step's GPU time by kind of op (\`--profile-ops 12\`):" ""
  awk '/^ops of step/ { on = 1; next } on && /^(\||the ops that took|  rank [0-9]+:|\()/ { print; next } on { exit }' "$1" |
    tee -a "$out"
}
# A row of the side-by-side table: NAME RC JSON RATE-KEY SMI-PEAK-MIB ALLOC-BYTES-EXPR
side_row() {
  local name=$1 rc=$2 file=$3 key=$4 smi=$5 alloc=$6
  if ((rc != 0)); then
    local why
    why=$(json "$file" "s.get('error')")
    say "| $name | ${why:-$7} | | | |"
    return
  fi
  say "| $name | $(json "$file" "f\"{s['$key']:.0f}\"") | $(json "$file" "f\"{1e3 * s.get('step_s_median', s.get('step_time_s', 0)):.1f}\"") ms | $(mib_gib "$smi") | $alloc |"
}
# mpipe's own memory figures: all device memory it held at once (--summary's
# peak_device_bytes_per_rank: arenas as reserved, so the counterpart of max_memory_reserved), then the parts:
# weights+state of stage 0 from the plan table, peak activations
mpipe_mem() {
  local ws act all
  # The plan table's row ends in six sizes: weights, grads, optimizer, then three activations.
  ws=$(awk '/^stage +layers/ { getline; n = NF; print $(n - 11), $(n - 10), "+ grads", $(n - 9), $(n - 8), "+ optimizer", $(n - 7), $(n - 6); exit }' "$1")
  act=$(json "$2" "f\"{s['peak_activation_bytes_per_rank'][0] / 2**30:.2f} GiB\"")
  all=$(json "$2" "f\"{s['peak_device_bytes_per_rank'][0] / 2**30:.2f} GiB\"")
  echo "${all:-?} held (weights ${ws:-?} (plan) + activations ${act:-?} + scratch)"
}
ratio() { [[ -n $1 && -n $2 ]] && calc "f'{$1 / $2:.2f}'"; }
x() { [[ -n $1 ]] && echo "${1}x" || echo "n/a"; }  # a ratio as 1.23x, or n/a

if [[ -z $torch_py ]]; then
  say "" "Not run: $torch_why."
  step_rows+=("| PyTorch side by side | not run: $torch_why | 0 |")
else
  # -- 4a. GPT-2 medium
  gpt_shape=(--layers 24 --d-model 1024 --heads 16 --seq-len 1024 --vocab 50257 --batch-size 8)
  cap=150; name_of_step="PyTorch GPT-2 medium eager"
  torch_run "PyTorch GPT-2 medium eager" torch-gpt-eager gpt --mode eager "${gpt_shape[@]}"
  te_rc=$step_rc te_status=$step_status te_smi=$smi_peak
  cap=300; name_of_step="PyTorch GPT-2 medium torch.compile"
  if ((compile)); then
    torch_run "PyTorch GPT-2 medium torch.compile" torch-gpt-compile gpt --mode compile "${gpt_shape[@]}"
    tc_rc=$step_rc tc_status=$step_status tc_smi=$smi_peak
  else
    tc_rc=-1 tc_status="not run (--no-compile)" tc_smi=""
    step_rows+=("| PyTorch GPT-2 medium torch.compile | not run (--no-compile) | 0 |")
  fi
  cap=150; name_of_step="mpipe GPT-2 medium"
  mpipe_run "mpipe GPT-2 medium, 1 rank" mpipe-gpt "${gpt_shape[@]}" --micro-batches 1
  mg_rc=$step_rc mg_status=$step_status mg_smi=$smi_peak
  say "" "### 4a. GPT-2 medium: 24 blocks, C 1024, T 1024, V 50257, 16 heads, batch 8, bf16, AdamW" "" \
      "PyTorch: \`scripts/torch_gpu_bench.py gpt\` (bf16 autocast, scaled_dot_product_attention, fused AdamW," \
      "3 warm-up steps untimed, median of 10). mpipe: \`mpipe train --device cuda --precision bf16 --layers 24" \
      "--d-model 1024 --heads 16 --seq-len 1024 --vocab 50257 --batch-size 8 --micro-batches 1 --steps 12\`" \
      "on 1 rank, unbound (\`--bind-to none\`: it reads each next batch on the node's cores during the step; median step, the first excluded). GPU memory: the highest \`nvidia-smi\` reading during" \
      "the run less the one at its start (CUDA context, allocator caches and workspaces included)." "" \
      "| run | tokens/s | median step | GPU memory (nvidia-smi) | allocator / own count |" "|---|---|---|---|---|"
  side_row "PyTorch eager" "$te_rc" "$logs/torch-gpt-eager.json" tokens_per_s "$te_smi" \
    "$(gib "$(json "$logs/torch-gpt-eager.json" "s.get('peak_allocated_bytes')")") allocated, $(gib "$(json "$logs/torch-gpt-eager.json" "s.get('peak_reserved_bytes')")") reserved" "$te_status"
  side_row "PyTorch torch.compile" "$tc_rc" "$logs/torch-gpt-compile.json" tokens_per_s "$tc_smi" \
    "$(gib "$(json "$logs/torch-gpt-compile.json" "s.get('peak_allocated_bytes')")") allocated, $(gib "$(json "$logs/torch-gpt-compile.json" "s.get('peak_reserved_bytes')")") reserved" "$tc_status"
  side_row "mpipe, 1 rank" "$mg_rc" "$logs/mpipe-gpt.json" tokens_per_s "$mg_smi" \
    "$(mpipe_mem "$logs/mpipe-gpt.log" "$logs/mpipe-gpt.json")" "$mg_status"
  m_tps=$( ((mg_rc == 0)) && json "$logs/mpipe-gpt.json" "s['tokens_per_s']")
  e_tps=$( ((te_rc == 0)) && json "$logs/torch-gpt-eager.json" "s['tokens_per_s']")
  c_tps=$( ((tc_rc == 0)) && json "$logs/torch-gpt-compile.json" "s['tokens_per_s']")
  gpt_eager_ratio=$(ratio "$m_tps" "$e_tps")
  gpt_compile_ratio=$(ratio "$m_tps" "$c_tps")
  warm=$(json "$logs/torch-gpt-compile.json" "f\"{s['warmup_s']:.0f}\"")
  say "" "mpipe / eager: $(x "$gpt_eager_ratio"); mpipe / torch.compile: $(x "$gpt_compile_ratio")"
  op_table "$logs/mpipe-gpt.log" "mpipe GPT-2 medium, M = 1"
  [[ -n $warm ]] && say "(the 3 warm-up steps of torch.compile, compilation included, took $warm s)"
  if [[ -n $mg_smi && -n $te_smi ]] && ((mg_rc == 0 && te_rc == 0)); then
    gpt_mem="$(mib_gib "$mg_smi") vs $(mib_gib "$te_smi")" gpt_mem_ok=$((mg_smi <= te_smi))
  fi
  step_rc=$te_rc step_status=$te_status; ((te_rc > 0)) && name_of_step="PyTorch eager" failure "$logs/torch-gpt-eager.log"
  step_rc=$tc_rc step_status=$tc_status; ((tc_rc > 0)) && name_of_step="PyTorch torch.compile" failure "$logs/torch-gpt-compile.log"
  step_rc=$mg_rc step_status=$mg_status; ((mg_rc > 0)) && name_of_step="mpipe GPT-2 medium" failure "$logs/mpipe-gpt.log"

  # -- 4c. The same batch as 8 micro-batches of 1 on one rank: what each GPU of a pipeline
  # computes (GPipe wants M >= 4K), against mpipe's M = 1 above and PyTorch's gradient
  # accumulation over the same 8 pieces (issue 46).
  cap=150
  torch_run "PyTorch GPT-2 medium eager, 8 micro-batches" torch-gpt-accum gpt --mode eager "${gpt_shape[@]}" --micro-batches 8
  ta_rc=$step_rc ta_status=$step_status ta_smi=$smi_peak
  mpipe_run "mpipe GPT-2 medium, 8 micro-batches" mpipe-gpt-m8 "${gpt_shape[@]}" --micro-batches 8
  m8_rc=$step_rc m8_status=$step_status m8_smi=$smi_peak
  mpipe_run "mpipe GPT-2 medium, 8 micro-batches, CUDA graphs" mpipe-gpt-m8g "${gpt_shape[@]}" --micro-batches 8 --cuda-graphs on
  m8g_rc=$step_rc m8g_status=$step_status m8g_smi=$smi_peak
  say "" "### 4c. GPT-2 medium's batch of 8 as M = 8 micro-batches of 1 sample, one rank" "" \
      "What each GPU of a pipeline computes. PyTorch: \`torch_gpu_bench.py gpt --micro-batches 8\` (forward and" \
      "backward of each piece, loss / 8, one clip and one fused AdamW step). mpipe: as 4a with \`--micro-batches 8\`." "" \
      "| run | tokens/s | median step | GPU memory (nvidia-smi) | allocator / own count |" "|---|---|---|---|---|"
  side_row "PyTorch eager, accumulation over 8" "$ta_rc" "$logs/torch-gpt-accum.json" tokens_per_s "$ta_smi" \
    "$(gib "$(json "$logs/torch-gpt-accum.json" "s.get('peak_allocated_bytes')")") allocated" "$ta_status"
  side_row "mpipe, 1 rank, M = 8" "$m8_rc" "$logs/mpipe-gpt-m8.json" tokens_per_s "$m8_smi" \
    "$(mpipe_mem "$logs/mpipe-gpt-m8.log" "$logs/mpipe-gpt-m8.json")" "$m8_status"
  side_row "mpipe, 1 rank, M = 8, \`--cuda-graphs on\`" "$m8g_rc" "$logs/mpipe-gpt-m8g.json" tokens_per_s "$m8g_smi" \
    "$(mpipe_mem "$logs/mpipe-gpt-m8g.log" "$logs/mpipe-gpt-m8g.json")" "$m8g_status"
  m8_tps=$( ((m8_rc == 0)) && json "$logs/mpipe-gpt-m8.json" "s['tokens_per_s']")
  a_tps=$( ((ta_rc == 0)) && json "$logs/torch-gpt-accum.json" "s['tokens_per_s']")
  micro_ratio=$(ratio "$m8_tps" "$m_tps")
  micro_torch_ratio=$(ratio "$m8_tps" "$a_tps")
  say "" "mpipe M = 8 / mpipe M = 1: $(x "$micro_ratio"); mpipe M = 8 / PyTorch's accumulation: $(x "$micro_torch_ratio")"
  m8g_tps=$( ((m8g_rc == 0)) && json "$logs/mpipe-gpt-m8g.json" "s['tokens_per_s']")
  graphs_ratio=$(ratio "$m8g_tps" "$m8_tps")
  graphs_micro_ratio=$(ratio "$m8g_tps" "$m_tps")
  say "" "With \`--cuda-graphs on\`: M = 8 / M = 8 without graphs: $(x "$graphs_ratio"); / M = 1: $(x "$graphs_micro_ratio")." \
      "$(grep -m1 '^CUDA graphs per rank' "$logs/mpipe-gpt-m8g.log" 2>/dev/null)"
  op_table "$logs/mpipe-gpt-m8.log" "mpipe GPT-2 medium, M = 8"
  step_rc=$ta_rc step_status=$ta_status; ((ta_rc > 0)) && name_of_step="PyTorch accumulation" failure "$logs/torch-gpt-accum.log"
  step_rc=$m8_rc step_status=$m8_status; ((m8_rc > 0)) && name_of_step="mpipe GPT-2 medium M = 8" failure "$logs/mpipe-gpt-m8.log"
  step_rc=$m8g_rc step_status=$m8g_status; ((m8g_rc > 0)) && name_of_step="mpipe GPT-2 medium M = 8, CUDA graphs" failure "$logs/mpipe-gpt-m8g.log"

  # -- 4b. ResNet-50
  cap=150
  torch_run "PyTorch ResNet-50 eager" torch-resnet-eager resnet --mode eager --layers 50 --image 224 --width 64 \
    --classes 1000 --batch-size 64
  re_rc=$step_rc re_status=$step_status re_smi=$smi_peak
  mpipe_run "mpipe ResNet-50, 1 rank" mpipe-resnet --model resnet --layers 50 --image 224 --width 64 --classes 1000 \
    --batch-size 64 --micro-batches 1
  mr_rc=$step_rc mr_status=$step_status mr_smi=$smi_peak
  # The same with the images NHWC end to end (--channels-last on: cuDNN's NHWC kernels, no
  # transposes of its own; BatchNorm, pooling and the rest over channels last).
  mpipe_run "mpipe ResNet-50, 1 rank, channels last" mpipe-resnet-cl --model resnet --layers 50 --image 224 --width 64 \
    --classes 1000 --batch-size 64 --micro-batches 1 --channels-last on
  mc_rc=$step_rc mc_status=$step_status mc_smi=$smi_peak
  say "" "### 4b. ResNet-50: 224x224, batch 64, 1000 classes, bf16, AdamW" "" \
      "PyTorch: \`scripts/torch_gpu_bench.py resnet\` (torchvision's v1.5 written out, 25,557,032 parameters;" \
      "bf16 autocast, channels_last, eager). mpipe: \`mpipe train --model resnet --layers 50 --image 224" \
      "--width 64 --classes 1000 --batch-size 64 --device cuda --precision bf16 --steps 12\` on 1 rank, unbound." "" \
      "| run | images/s | median step | GPU memory (nvidia-smi) | allocator / own count |" "|---|---|---|---|---|"
  side_row "PyTorch eager" "$re_rc" "$logs/torch-resnet-eager.json" samples_per_s "$re_smi" \
    "$(gib "$(json "$logs/torch-resnet-eager.json" "s.get('peak_allocated_bytes')")") allocated, $(gib "$(json "$logs/torch-resnet-eager.json" "s.get('peak_reserved_bytes')")") reserved" "$re_status"
  side_row "mpipe, 1 rank" "$mr_rc" "$logs/mpipe-resnet.json" samples_per_s "$mr_smi" \
    "$(mpipe_mem "$logs/mpipe-resnet.log" "$logs/mpipe-resnet.json")" "$mr_status"
  side_row "mpipe, 1 rank, --channels-last on" "$mc_rc" "$logs/mpipe-resnet-cl.json" samples_per_s "$mc_smi" \
    "$(mpipe_mem "$logs/mpipe-resnet-cl.log" "$logs/mpipe-resnet-cl.json")" "$mc_status"
  m_ips=$( ((mr_rc == 0)) && json "$logs/mpipe-resnet.json" "s['samples_per_s']")
  cl_ips=$( ((mc_rc == 0)) && json "$logs/mpipe-resnet-cl.json" "s['samples_per_s']")
  e_ips=$( ((re_rc == 0)) && json "$logs/torch-resnet-eager.json" "s['samples_per_s']")
  nchw_ratio=$(ratio "$m_ips" "$e_ips") nhwc_ratio=$(ratio "$cl_ips" "$e_ips")
  say "" "mpipe / eager: $(x "$nchw_ratio") NCHW, $(x "$nhwc_ratio") channels last"
  # The targets read the faster layout (and its memory); section 6 compares it too.
  resnet_layout=NCHW r_smi=$mr_smi r_rc=$mr_rc
  if [[ -n $cl_ips ]] && { [[ -z $m_ips ]] || (($(calc "int($cl_ips > $m_ips)"))); }; then
    m_ips=$cl_ips resnet_layout="channels last" r_smi=$mc_smi r_rc=$mc_rc
  fi
  resnet_ratio=$(ratio "$m_ips" "$e_ips")
  op_table "$logs/mpipe-resnet.log" "mpipe ResNet-50"
  op_table "$logs/mpipe-resnet-cl.log" "mpipe ResNet-50, channels last"
  if [[ -n $r_smi && -n $re_smi ]] && ((r_rc == 0 && re_rc == 0)); then
    resnet_mem="$(mib_gib "$r_smi") ($resnet_layout) vs $(mib_gib "$re_smi")" resnet_mem_ok=$((r_smi <= re_smi))
  fi
  step_rc=$re_rc step_status=$re_status; ((re_rc > 0)) && name_of_step="PyTorch ResNet-50" failure "$logs/torch-resnet-eager.log"
  step_rc=$mr_rc step_status=$mr_status; ((mr_rc > 0)) && name_of_step="mpipe ResNet-50" failure "$logs/mpipe-resnet.log"
  step_rc=$mc_rc step_status=$mc_status; ((mc_rc > 0)) && name_of_step="mpipe ResNet-50 channels last" failure "$logs/mpipe-resnet-cl.log"

  # -- 4d. A Llama: Llama-3.2-1B's block (C 2048, 32 heads, 8 key/value heads, SwiGLU 8192)
  # cut to 8 of its 16 blocks, so that eager, torch.compile and mpipe each fit the GPU and
  # the budget; untied head, V 32000 (Llama 2's), RoPE base 500000, RMSNorm eps 1e-5.
  llama_shape=(--layers 8 --d-model 2048 --heads 32 --kv-heads 8 --ffn 8192 --vocab 32000 --seq-len 1024 --batch-size 8
    --rope-theta 500000 --norm-eps 1e-5 --tie-embeddings off)
  cap=150; name_of_step="PyTorch Llama eager"
  torch_run "PyTorch Llama (8 x 2048, GQA 32/8) eager" torch-llama-eager llama --mode eager "${llama_shape[@]}"
  le_rc=$step_rc le_status=$step_status le_smi=$smi_peak
  cap=300; name_of_step="PyTorch Llama torch.compile"
  if ((compile)); then
    torch_run "PyTorch Llama (8 x 2048, GQA 32/8) torch.compile" torch-llama-compile llama --mode compile "${llama_shape[@]}"
    lc_rc=$step_rc lc_status=$step_status lc_smi=$smi_peak
  else
    lc_rc=-1 lc_status="not run (--no-compile)" lc_smi=""
    step_rows+=("| PyTorch Llama torch.compile | not run (--no-compile) | 0 |")
  fi
  cap=150; name_of_step="mpipe Llama"
  mpipe_run "mpipe Llama (8 x 2048, GQA 32/8), 1 rank" mpipe-llama --model llama "${llama_shape[@]}" --micro-batches 1
  ml_rc=$step_rc ml_status=$step_status ml_smi=$smi_peak
  say "" "### 4d. Llama: Llama-3.2-1B's blocks (C 2048, 32 heads, 8 key/value heads, SwiGLU 8192) cut to 8, T 1024, V 32000, batch 8, bf16, AdamW" "" \
      "PyTorch: \`scripts/torch_gpu_bench.py llama\` (RMSNorm, RoPE rotate-half, grouped-query attention through" \
      "scaled_dot_product_attention, SwiGLU, no biases, untied head; bf16 autocast, fused AdamW, 3 warm-up steps untimed," \
      "median of 10). mpipe: \`mpipe train --model llama --layers 8 --d-model 2048 --heads 32 --kv-heads 8 --ffn 8192" \
      "--vocab 32000 --seq-len 1024 --batch-size 8 --rope-theta 500000 --norm-eps 1e-5 --tie-embeddings off" \
      "--micro-batches 1 --steps 12\` on 1 rank, unbound; synthetic tokens on both." "" \
      "| run | tokens/s | median step | GPU memory (nvidia-smi) | allocator / own count |" "|---|---|---|---|---|"
  side_row "PyTorch eager" "$le_rc" "$logs/torch-llama-eager.json" tokens_per_s "$le_smi" \
    "$(gib "$(json "$logs/torch-llama-eager.json" "s.get('peak_allocated_bytes')")") allocated, $(gib "$(json "$logs/torch-llama-eager.json" "s.get('peak_reserved_bytes')")") reserved" "$le_status"
  side_row "PyTorch torch.compile" "$lc_rc" "$logs/torch-llama-compile.json" tokens_per_s "$lc_smi" \
    "$(gib "$(json "$logs/torch-llama-compile.json" "s.get('peak_allocated_bytes')")") allocated, $(gib "$(json "$logs/torch-llama-compile.json" "s.get('peak_reserved_bytes')")") reserved" "$lc_status"
  side_row "mpipe, 1 rank" "$ml_rc" "$logs/mpipe-llama.json" tokens_per_s "$ml_smi" \
    "$(mpipe_mem "$logs/mpipe-llama.log" "$logs/mpipe-llama.json")" "$ml_status"
  ml_tps=$( ((ml_rc == 0)) && json "$logs/mpipe-llama.json" "s['tokens_per_s']")
  le_tps=$( ((le_rc == 0)) && json "$logs/torch-llama-eager.json" "s['tokens_per_s']")
  lc_tps=$( ((lc_rc == 0)) && json "$logs/torch-llama-compile.json" "s['tokens_per_s']")
  llama_eager_ratio=$(ratio "$ml_tps" "$le_tps")
  llama_compile_ratio=$(ratio "$ml_tps" "$lc_tps")
  say "" "mpipe / eager: $(x "$llama_eager_ratio"); mpipe / torch.compile: $(x "$llama_compile_ratio")"
  op_table "$logs/mpipe-llama.log" "mpipe Llama, M = 1"
  if [[ -n $ml_smi && -n $le_smi ]] && ((ml_rc == 0 && le_rc == 0)); then
    llama_mem="$(mib_gib "$ml_smi") vs $(mib_gib "$le_smi")"
  fi
  step_rc=$le_rc step_status=$le_status; ((le_rc > 0)) && name_of_step="PyTorch Llama eager" failure "$logs/torch-llama-eager.log"
  step_rc=$lc_rc step_status=$lc_status; ((lc_rc > 0)) && name_of_step="PyTorch Llama torch.compile" failure "$logs/torch-llama-compile.log"
  step_rc=$ml_rc step_status=$ml_status; ((ml_rc > 0)) && name_of_step="mpipe Llama" failure "$logs/mpipe-llama.log"
fi

# ---- 5. CPU K ladder -------------------------------------------------------------------------
say "" "## 5. CPU K ladder (K = 1, 2, 4, 8; M = 32)"
if [[ $ladder == 0 ]] || { [[ $ladder == auto ]] && ((cores < 16)); }; then
  say "" "Not run: $( [[ $ladder == 0 ]] && echo '--no-ladder' || echo "$cores cores here, 16 wanted (--ladder runs it anyway)")."
  step_rows+=("| CPU K ladder | not run | 0 |")
else
  # scripts/scaling_check.sh: the machine's topology and single-copy, the ladder on the
  # 8 x 256 GPT (one block a stage at K = 8) and a 32 x 128 one (four), the contention
  # baseline, and where the time goes at K = 8 (issue 47).
  say "" "scripts/scaling_check.sh (M = 32, 3 timed steps a run; its own budget of 290 s):" ""
  step "CPU scaling (scaling_check.sh)" 300 "$logs/scaling.log" env MPIPE="$mpipe" BUDGET=280 bash scripts/scaling_check.sh
  code "$logs/scaling.log"
  ladder_speedup=$(awk '$1 == "RESULT" && $2 == "ladder" && $3 == 8 { printf "%.2f", $4 }' "$logs/scaling.log")
  deep_speedup=$(awk '$1 == "RESULT" && $2 == "deep" && $3 == 8 { printf "%.2f", $4 }' "$logs/scaling.log")
  deep_machine=$(awk '$1 == "RESULT" && $2 == "deep" && $3 == 8 && $6 > 0 { printf "%.2f", $4 / $6 }' "$logs/scaling.log")
  deep_k4=$(awk '$1 == "RESULT" && $2 == "deep" && $3 == 4 { printf "%.2f", $4 }' "$logs/scaling.log")
  say "" "K = 8 over K = 1: ladder model $(x "$ladder_speedup"), deep model $(x "$deep_speedup") (target 6.0x, or 0.95x the" \
      "contention baseline's bound: ${deep_machine:-n/a} of it); deep K = 4: $(x "$deep_k4") (target 3.5x)"
  # The U-Net at K = 2 with its skips across the cut, on two of the many cores (issue 50:
  # >= 0.9x the GPipe bound, which the 2-core VM's contention cannot give).
  say "" "scripts/bench_unet.sh (U-Net, K = 2, M = 8; 2 rounds of 15 steps):" ""
  step "U-Net K = 2 (bench_unet.sh)" 180 "$logs/unet.log" env MPIPE="$mpipe" ROUNDS=2 STEPS=15 bash scripts/bench_unet.sh
  code "$logs/unet.log"
  unet_of_bound=$(awk '$1 == "RESULT" && $4 + 0 > best { best = $4 + 0; name = $2 } END { if (name != "") printf "%.2f", best }' "$logs/unet.log")
  unet_row=$(awk '$1 == "RESULT" && $4 + 0 > best { best = $4 + 0; name = $2 } END { print name }' "$logs/unet.log")
fi

# ---- 6. ResNet-50 against torch.compile ------------------------------------------------------
# Last, on what is left of the budget: its compilation takes minutes, which the ladder's
# measurements above must not lose (issue 46's ResNet-50 >= 1.0x torch.compile).
say "" "## 6. ResNet-50 against torch.compile (on the budget left)"
resnet_compile_ratio=""
if [[ -z $torch_py ]] || ((!compile)) || [[ -z $m_ips ]]; then
  say "" "Not run: $( [[ -z $torch_py ]] && echo "$torch_why" || { ((!compile)) && echo '--no-compile' || echo "mpipe's ResNet-50 run above did not succeed"; })."
  step_rows+=("| PyTorch ResNet-50 torch.compile | not run | 0 |")
else
  cap=240; name_of_step="PyTorch ResNet-50 torch.compile"
  torch_run "PyTorch ResNet-50 torch.compile" torch-resnet-compile resnet --mode compile --layers 50 --image 224 \
    --width 64 --classes 1000 --batch-size 64
  rc_rc=$step_rc rc_status=$step_status rc_smi=$smi_peak
  say "" "| run | images/s | median step | GPU memory (nvidia-smi) | allocator / own count |" "|---|---|---|---|---|"
  side_row "PyTorch torch.compile" "$rc_rc" "$logs/torch-resnet-compile.json" samples_per_s "$rc_smi" \
    "$(gib "$(json "$logs/torch-resnet-compile.json" "s.get('peak_allocated_bytes')")") allocated" "$rc_status"
  c_ips=$( ((rc_rc == 0)) && json "$logs/torch-resnet-compile.json" "s['samples_per_s']")
  resnet_compile_ratio=$(ratio "$m_ips" "$c_ips")
  say "" "mpipe (section 4b, $resnet_layout) / torch.compile: $(x "$resnet_compile_ratio")"
  step_rc=$rc_rc step_status=$rc_status; ((rc_rc > 0)) && failure "$logs/torch-resnet-compile.log"
fi

# ---- targets and steps ---------------------------------------------------------------------------
verdict() {  # VALUE OP TARGET -> met / missed / not measured
  [[ -n $1 ]] || { echo "not measured"; return; }
  calc "'met' if $1 $2 $3 else 'missed'"
}
say "" "## Targets" "" "| target | measured | |" "|---|---|---|" \
    "| GPT-2 medium: mpipe ≥ 1.0x torch.compile | ${gpt_compile_ratio:+${gpt_compile_ratio}x} | $(verdict "$gpt_compile_ratio" '>=' 1.0) |" \
    "| GPT-2 medium: mpipe / eager (for reference) | ${gpt_eager_ratio:+${gpt_eager_ratio}x} | |" \
    "| Llama (8 x 2048, GQA 32/8): mpipe / torch.compile (for reference) | ${llama_compile_ratio:+${llama_compile_ratio}x} | |" \
    "| Llama: mpipe / eager (for reference) | ${llama_eager_ratio:+${llama_eager_ratio}x} | |" \
    "| Llama: peak GPU memory, mpipe vs eager (nvidia-smi, for reference) | $llama_mem | |" \
    "| MFU ≥ 50% (bench_gpu whole step) | ${mfu:+${mfu}%} | $(verdict "$mfu" '>=' 50) |" \
    "| attention forward ≥ 50% of the GEMM rate | ${att_f:+${att_f}%} | $(verdict "$att_f" '>=' 50) |" \
    "| attention backward ≥ 40% of the GEMM rate | ${att_b:+${att_b}%} | $(verdict "$att_b" '>=' 40) |" \
    "| GPT-2 medium, batch 8 as M = 8 on one rank ≥ 0.85x M = 1 | ${micro_ratio:+${micro_ratio}x} | $(verdict "$micro_ratio" '>=' 0.85) |" \
    "| … and ≥ 1.0x PyTorch's accumulation over the same 8 pieces | ${micro_torch_ratio:+${micro_torch_ratio}x} | $(verdict "$micro_torch_ratio" '>=' 1.0) |" \
    "| … M = 8 with \`--cuda-graphs on\` ≥ 0.85x M = 1 | ${graphs_micro_ratio:+${graphs_micro_ratio}x} | $(verdict "$graphs_micro_ratio" '>=' 0.85) |" \
    "| … \`--cuda-graphs on\` / off at M = 8 (for reference) | ${graphs_ratio:+${graphs_ratio}x} | |" \
    "| ResNet-50: mpipe ≥ 1.3x eager | ${resnet_ratio:+${resnet_ratio}x} | $(verdict "$resnet_ratio" '>=' 1.3) |" \
    "| ResNet-50: mpipe ≥ 1.0x torch.compile | ${resnet_compile_ratio:+${resnet_compile_ratio}x} | $(verdict "$resnet_compile_ratio" '>=' 1.0) |" \
    "| GPT-2 medium: peak GPU memory ≤ eager's (nvidia-smi, mpipe vs eager) | $gpt_mem | $(verdict "$gpt_mem_ok" == 1) |" \
    "| ResNet-50: peak GPU memory ≤ eager's (nvidia-smi, mpipe vs eager) | $resnet_mem | $(verdict "$resnet_mem_ok" == 1) |" \
    "| CPU K ladder, deep model: K = 8 ≥ 6.0x K = 1 (M = 32) | ${deep_speedup:+${deep_speedup}x} | $(verdict "$deep_speedup" '>=' 6.0) |" \
    "| … or ≥ 0.95x the contention baseline's bound | ${deep_machine:+${deep_machine}x of it} | $(verdict "$deep_machine" '>=' 0.95) |" \
    "| CPU K ladder, deep model: K = 4 ≥ 3.5x | ${deep_k4:+${deep_k4}x} | $(verdict "$deep_k4" '>=' 3.5) |" \
    "| CPU K ladder, 8 x 256 model: K = 8 (for reference) | ${ladder_speedup:+${ladder_speedup}x} | |" \
    "| U-Net at K = 2, skips across the cut: ≥ 0.9x the GPipe bound (best row${unet_row:+: $unet_row}) | ${unet_of_bound:+${unet_of_bound}x of it} | $(verdict "$unet_of_bound" '>=' 0.9) |"
say "" "## Steps" "" "| step | result | seconds |" "|---|---|---|"
for r in "${step_rows[@]}"; do say "$r"; done
say "" "Total: $SECONDS s; $( ((failed)) && echo 'some steps FAILED (exit 1)' || echo 'no step failed'). Report: $out"
exit $failed
