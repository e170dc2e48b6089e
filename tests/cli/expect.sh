#!/usr/bin/env bash
# Runs a command and checks its exit code and that its output matches a regex.
# Usage: expect.sh CODE REGEX -- command args...
# Bad input must also give exactly one error line (no stack trace, no repetition).
set -u
code=$1 regex=$2
shift 3
out=$(timeout 120 "$@" 2>&1)
rc=$?
fail() { printf 'FAIL: %s\n--- command: %s\n--- exit code: %s\n--- output:\n%s\n' "$1" "$*" "$rc" "$out"; exit 1; }
[[ $rc -eq $code ]] || fail "expected exit code $code"
grep -Eq -- "$regex" <<<"$out" || fail "output does not match /$regex/"
if [[ $code -eq 2 ]]; then
  n=$(grep -c 'error' <<<"$out")
  [[ $n -eq 1 ]] || fail "expected exactly one error line, got $n"
fi
echo "ok: exit $rc, output matches /$regex/"
