#!/usr/bin/env bash
# scripts/gpu_check.sh's logic without a GPU: the no-GPU exit (2, one line), argument handling,
# the plan's device time against the 8-minute budget, the build stamp (a stand-in nvidia-smi
# lets the run mode reach the build check: the prepared build passes, another one is refused
# with exit 3), and the CPU halves of the comparisons with their report.
# Usage: tests/cli/gpu_check_test.sh BUILD_DIR
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=$(cd "$1" && pwd)
fail() { echo "FAIL: $*"; exit 1; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# No GPU: exit 2 at once, one line (PATH without nvidia-smi).
out=$(PATH=/usr/bin:/bin scripts/gpu_check.sh "$BUILD" 2>&1); rc=$?
[ "$rc" = 2 ] || fail "no GPU: exit $rc, not 2"
[ "$(printf '%s\n' "$out" | wc -l)" = 1 ] || fail "no GPU: more than one line: $out"
scripts/gpu_check.sh --bogus >/dev/null 2>&1; [ $? = 64 ] || fail "an unknown option is not refused"

# The plan fits the budget.
total=$(scripts/gpu_check.sh --plan "$BUILD" | sed -n 's/^expected device time: \([0-9]*\) s.*/\1/p')
[ -n "$total" ] && [ "$total" -le 480 ] || fail "expected device time '$total' s is over 480 s"

# The build stamp, through a stand-in nvidia-smi (only the build step runs).
if [ -f "$BUILD/cli/libreshard_cuda.so" ] && [ -f "$BUILD/tests/test_cuda" ]; then
  mkdir -p "$TMP/bin"
  printf '#!/bin/sh\necho "GPU 0: stand-in (UUID: GPU-0)"\n' >"$TMP/bin/nvidia-smi"
  chmod +x "$TMP/bin/nvidia-smi"
  cp "$BUILD/gpu_check.stamp" "$TMP/stamp.keep" 2>/dev/null
  scripts/gpu_check.sh --prepare "$BUILD" >/dev/null || fail "--prepare"
  PATH="$TMP/bin:$PATH" scripts/gpu_check.sh "$BUILD" --only build --out "$TMP/ok" >/dev/null 2>&1 ||
    fail "the prepared build is refused: $(cat "$TMP/ok/report.txt")"
  grep -q '^build  *PASS' "$TMP/ok/report.txt" || fail "no build PASS row"
  sed -i 's/^reshard .*/reshard 0000000000000000/' "$BUILD/gpu_check.stamp"
  PATH="$TMP/bin:$PATH" scripts/gpu_check.sh "$BUILD" --only build --out "$TMP/bad" >/dev/null 2>&1; rc=$?
  [ -f "$TMP/stamp.keep" ] && cp "$TMP/stamp.keep" "$BUILD/gpu_check.stamp" || rm -f "$BUILD/gpu_check.stamp"
  [ "$rc" = 3 ] || fail "another build: exit $rc, not 3"
else
  echo "note: no CUDA build here; the stamp check was not exercised"
fi

# The CPU halves, and the report's rows.
scripts/gpu_check.sh --cpu-reference "$BUILD" --only families,resume --out "$TMP/cpu" >/dev/null 2>&1 ||
  fail "--cpu-reference: $(cat "$TMP/cpu/report.txt")"
for row in "families.*PASS.*moe: CPU losses" "families.*PASS.*mixtral" "families.*PASS.*qwen3_moe" "resume.*PASS"; do
  grep -q "$row" "$TMP/cpu/report.txt" || fail "no row '$row' in $(cat "$TMP/cpu/report.txt")"
done
echo "gpu_check logic: ok"
