#!/usr/bin/env bash
# What the GEMM kernel set costs the training core: bench_moe_layer (small-moe's MoE layer at
# 4096 tokens, forward + backward) with OpenBLAS's SSE fallback kernels (OPENBLAS_CORETYPE=
# Prescott, what Debian 12's OpenBLAS picks on CPUs newer than it) and with the kernels reshard
# selects (train/ops/blas_kernels.h), alternately ROUNDS times in one run; prints the best sgemm
# peak and tokens/s of each and their ratios.
#
# Usage: bench/blas_kernels.sh [BUILD_DIR (build)] [ROUNDS (2)]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
ROUNDS=${2:-2}
BIN=$BUILD/bench/bench_moe_layer
best() { awk -v a="$1" -v b="$2" 'BEGIN { print (a == "" || b > a) ? b : a }'; }
fb_peak="" fb_tps="" ok_peak="" ok_tps="" ok_core=""
for ((i = 1; i <= ROUNDS; ++i)); do
  out=$(OPENBLAS_CORETYPE=Prescott "$BIN")
  fb_peak=$(best "$fb_peak" "$(sed -n 's/^sgemm peak measured again: .*; using \([0-9.]*\)/\1/p' <<<"$out")")
  fb_tps=$(best "$fb_tps" "$(sed -n 's/^  fused .*fwd+bwd .*ms, *\([0-9]*\) tokens\/s.*/\1/p' <<<"$out")")
  out=$(env -u OPENBLAS_CORETYPE "$BIN")
  ok_core=$(sed -n 's/^gemm: .*; core \([A-Za-z0-9]*\) .*/\1/p' <<<"$out")
  ok_peak=$(best "$ok_peak" "$(sed -n 's/^sgemm peak measured again: .*; using \([0-9.]*\)/\1/p' <<<"$out")")
  ok_tps=$(best "$ok_tps" "$(sed -n 's/^  fused .*fwd+bwd .*ms, *\([0-9]*\) tokens\/s.*/\1/p' <<<"$out")")
  echo "round $i: Prescott ${fb_peak} GFLOP/s ${fb_tps} tok/s; $ok_core ${ok_peak} GFLOP/s ${ok_tps} tok/s" >&2
done
awk -v fp="$fb_peak" -v ft="$fb_tps" -v op="$ok_peak" -v ot="$ok_tps" -v core="$ok_core" 'BEGIN {
  printf "sgemm peak: Prescott (SSE) %.1f GFLOP/s, %s %.1f GFLOP/s: %.2fx\n", fp, core, op, op / fp
  printf "MoE layer fwd+bwd: Prescott %d tokens/s, %s %d tokens/s: %.2fx\n", ft, core, ot, ot / ft
}'
