#!/usr/bin/env bash
# A skip's message lost (MPIPE_TEST_FAIL=0:5:lose-skip: rank 0's first forward of step 5
# drops the first skip it sends): the U-Net at K = 2 has each rank wait for the other (rank
# 1 for the skip, rank 0 for the gradient rank 1 cannot compute), both alive. The job must
# end within --p2p-timeout + 3 s, exit 1, with one error line that names the wait (the
# skip by its name, or the gradient behind it) and says that every rank answers: a
# deadlock, not a stopped rank. Behaviour, not speed.
# Usage: lost_skip.sh MPIPE MODEL
set -u
mpipe=$1 model=$2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
fail() { printf 'FAIL: %s\n%s\n' "$1" "${2:-}"; exit 1; }
start=$(date +%s.%N)
out=$(timeout 60 mpiexec -n 2 --oversubscribe -x MPIPE_TEST_FAIL=0:5:lose-skip "$mpipe" train --model "$model" \
      --batch-size 8 --micro-batches 4 --steps 10 --threads 1 --log-every 1000 --p2p-timeout 2 2>&1)
rc=$?
took=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
[[ $rc -eq 1 ]] || fail "exit $rc, not 1" "$out"
awk -v t="$took" 'BEGIN { exit !(t <= 2 + 3 + 1) }' || fail "ended after $took s" "$out"
[[ $(grep -c "mpipe: error" <<<"$out") -eq 1 ]] || fail "not exactly one error line" "$out"
line=$(grep "mpipe: error" <<<"$out")
grep -Eq "timed out after 2 s waiting for (the skip 'level1' of micro-batch 0|the gradient of micro-batch 0)" <<<"$line" \
  || fail "the line names no lost wait" "$line"
grep -q "every rank answers" <<<"$line" || fail "the line does not say every rank answers" "$line"
echo "ended in $took s: $line"
