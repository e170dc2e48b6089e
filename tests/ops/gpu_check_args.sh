#!/usr/bin/env bash
# scripts/gpu_check.sh's arguments, on any machine (each case ends before the GPU is looked
# for): --out never destroys a file that is not a report, nor writes to a device; an option
# without its value is refused by name. Exit 0 when every case holds.
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
# refused NAME REGEX ARGS...: exit 2, the line matching REGEX
refused() {
  local name=$1 regex=$2; shift 2
  local out rc
  out=$(bash "$root/scripts/gpu_check.sh" "$@" 2>&1); rc=$?
  [[ $rc -eq 2 ]] || fail "$name: exit $rc, expected 2: $out"
  grep -Eq -- "$regex" <<<"$out" || fail "$name: output does not match /$regex/: $out"
  echo "ok: $name"
}
printf 'HDF\x89 not a report\n' > "$work/ckpt.h5"
before=$(md5sum < "$work/ckpt.h5")
refused "--out over a checkpoint" "--out '.*ckpt.h5' exists and is not a gpu_check report; hint" --out "$work/ckpt.h5"
[[ $(md5sum < "$work/ckpt.h5") == "$before" ]] || fail "the file given to --out was changed"
[[ ! -e "$work/ckpt-logs" && ! -e "$work/ckpt.h5-logs" ]] || fail "a logs directory was made beside the refused file"
refused "--out /dev/full" "--out '/dev/full' is not a regular file; hint" --out /dev/full
[[ ! -e /dev/full-logs ]] || fail "/dev/full-logs was created"
refused "--out a directory" "--out '$work' is not a regular file" --out "$work"
ln -s "$work/nowhere/x.md" "$work/dangling.md"
refused "--out a dangling link" "is not a regular file" --out "$work/dangling.md"
refused "--out without a value" "--out needs a value" --out
refused "--out followed by an option" "--out needs a value" --out --no-ladder
refused "--logs without a value" "--logs needs a value" --logs
refused "--budget not a number" "--budget takes seconds" --budget soon
touch "$work/plain"
refused "--logs a file" "--logs '.*plain' exists and is not a directory" --out "$work/r.md" --logs "$work/plain"
# An earlier report is written over (no GPU visible: the report says nothing was measured).
for round in 1 2; do
  out=$(CUDA_VISIBLE_DEVICES= bash "$root/scripts/gpu_check.sh" --out "$work/report.md" 2>&1) ||
    fail "report round $round: exit $?: $out"
done
grep -q "Nothing was measured" "$work/report.md" || fail "the report: $(cat "$work/report.md")"
[[ $(grep -c "^# mpipe GPU check" "$work/report.md") -eq 1 ]] || fail "the report was appended to, not written afresh"
echo "ok: an earlier report written over"
# Relative paths are the caller's: --out rel.md from another directory writes there, not
# into the repository; a file of binary (NUL bytes) is refused without a shell warning.
mkdir "$work/elsewhere"
out=$(cd "$work/elsewhere" && CUDA_VISIBLE_DEVICES= bash "$root/scripts/gpu_check.sh" --out rel.md 2>&1) ||
  fail "--out rel.md: exit $?: $out"
[[ -f "$work/elsewhere/rel.md" && -d "$work/elsewhere/rel-logs" ]] || fail "--out rel.md not written in the caller's directory"
[[ ! -e "$root/rel.md" ]] || { rm -rf "$root/rel.md" "$root/rel-logs"; fail "--out rel.md was written into the repository root"; }
echo "ok: --out relative to the caller's directory"
printf '\0\0\0binary' > "$work/nul.md"
refused "--out a file of NUL bytes" "exists and is not a gpu_check report" --out "$work/nul.md"
out=$(bash "$root/scripts/gpu_check.sh" --out "$work/nul.md" 2>&1)
! grep -q "null byte" <<<"$out" || fail "a shell warning: $out"
echo "ok: no null-byte warning"
