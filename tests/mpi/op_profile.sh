#!/usr/bin/env bash
# --profile-ops on a GPT at K = 2: after step 2 (and only then) rank 0 prints one row per
# rank of that step's op time by kind. Each row's kinds and its "outside ops" add up to
# its step time; both stages spend time in GEMMs and attention; the loss is the last
# stage's alone (the head lives there), and no convolution column appears for a model
# without one; then each rank's ops that took the most, by name. Behaviour, not speed.
# Usage: op_profile.sh MPIPE
set -u
mpipe=$1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
fail() { printf 'FAIL: %s\n%s\n' "$1" "${2:-}"; exit 1; }
out=$(timeout 60 mpiexec -n 2 --oversubscribe "$mpipe" train --model gpt --layers 4 --d-model 64 --heads 4 --seq-len 32 \
      --vocab 64 --batch-size 8 --micro-batches 4 --steps 3 --threads 1 --log-every 1 --profile-ops 2 2>&1)
rc=$?
[[ $rc -eq 0 ]] || fail "exit $rc" "$out"
[[ $(grep -c '^ops of step' <<<"$out") -eq 1 ]] || fail "not exactly one op table" "$out"
grep -q '^ops of step 2 by kind' <<<"$out" || fail "the table is not step 2's" "$out"
# The table comes after step 2's line and before step 3's.
order=$(grep -nE '^(step +[23]/3|ops of step)' <<<"$out" | cut -d: -f2 | cut -c1-6 | tr '\n' ' ')
[[ $order == "step   ops of step   " ]] || fail "the table is not between steps 2 and 3 ($order)" "$out"
header=$(grep -A1 '^ops of step' <<<"$out" | tail -1)
for kind in GEMM attention normalization elementwise loss optimizer copies; do
  grep -q "| $kind |" <<<"$header" || fail "no $kind column" "$header"
done
grep -q 'convolution' <<<"$header" && fail "a convolution column for a model without one" "$header"
# Column index of each name in the header (fields split on '|').
col() { awk -F'|' -v name="$1" '{ for (i = 2; i < NF; ++i) { f = $i; gsub(/^ +| +$/, "", f); if (f == name) print i } }' <<<"$header"; }
gemm=$(col GEMM) attention=$(col attention) loss=$(col loss)
rows=$(grep -E '^\| [01] \| [01] \| [0-9.]+ \|' <<<"$out")
[[ $(wc -l <<<"$rows") -eq 2 ]] || fail "not one row per rank" "$out"
while IFS= read -r row; do
  awk -F'|' -v g="$gemm" -v a="$attention" -v l="$loss" '
    function ms(i,   f) { f = $i; sub(/\(.*/, "", f); gsub(/ /, "", f); return f + 0 }
    {
      rank = ms(2); step = ms(4); sum = 0
      for (i = 5; i < NF; ++i) sum += ms(i)
      if (sum < step - 0.05 * NF || sum > step + 0.05 * NF) { print "kinds and outside add to " sum " ms, the step is " step; exit 1 }
      if (ms(g) <= 0) { print "rank " rank ": no GEMM time"; exit 1 }
      if (ms(a) <= 0) { print "rank " rank ": no attention time"; exit 1 }
      if (rank == 0 && ms(l) != 0) { print "rank 0 has loss time " ms(l) " without the head"; exit 1 }
      if (rank == 1 && ms(l) <= 0) { print "rank 1 has no loss time"; exit 1 }
    }' <<<"$row" || fail "row: $row" "$out"
done <<<"$rows"
# Then each rank's ops that took the most, by name: both ranks run GEMMs.
for r in 0 1; do
  grep -Eq "^  rank $r: .*matmul_(forward|backward|gelu_forward) [0-9.]+" <<<"$out" || fail "no top ops of rank $r naming a matmul" "$out"
done
grep -A7 '^ops of step' <<<"$out"
