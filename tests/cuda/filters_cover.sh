#!/usr/bin/env bash
# Every case of cuda_tests is run by some ctest entry: each of its names must pass one of
# the doctest filters the cuda.* entries give (a case whose name no filter takes would
# never run on a GPU, and nothing would say so). Needs no GPU: it only lists the cases.
# Usage: filters_cover.sh CUDA_TESTS FILTER...
set -u
bin=$1
shift
names() {  # the cases passing the filter (none: all), one a line
  "$bin" -ltc ${1:+"-tc=$1"} 2>/dev/null | awk '/^=+$/ { inside = !inside; next } inside'
}
all=$(names "")
[[ -n $all ]] || { echo "FAIL: $bin -ltc listed no test case"; exit 1; }
covered=""
for filter in "$@"; do covered+=$(names "$filter")$'\n'; done
missing=$(comm -23 <(sort -u <<<"$all") <(sort -u <<<"$covered" | sed '/^$/d'))
if [[ -n $missing ]]; then
  printf 'FAIL: no ctest filter runs these cuda_tests cases:\n%s\n' "$missing"
  exit 1
fi
echo "ok: $(wc -l <<<"$all") cases, each run by a filter of: $*"
