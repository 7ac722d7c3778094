#!/usr/bin/env bash
# What Qwen3-MoE's per-head q/k norms cost a CPU training step: bench_train_step (best step of
# STEPS) of the small-moe preset and of the same model with qk_norm, run alternately ROUNDS
# times in one run on the same machine; prints each run and the ratio of the best times
# (the issue's target: < 3 % more).
#
# Usage: bench/qk_norm_cost.sh [BUILD_DIR (build)] [ROUNDS (2)] [BATCH (4)] [SEQ (128)] [STEPS (3)]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
ROUNDS=${2:-2}
BATCH=${3:-4}
SEQ=${4:-128}
STEPS=${5:-3}
BIN=$BUILD/bench/bench_train_step
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
echo '{"preset": "small-moe", "name": "small-moe-qk-norm", "qk_norm": true}' > "$DIR/qk.json"
best() { awk -v a="$1" -v b="$2" 'BEGIN { print (a == "" || b < a) ? b : a }'; }
own="" qk=""
for r in $(seq "$ROUNDS"); do
  t=$("$BIN" small-moe "$BATCH" "$SEQ" "$STEPS" | awk '/^step / { print $2 }')
  own=$(best "$own" "$t")
  u=$("$BIN" "$DIR/qk.json" "$BATCH" "$SEQ" "$STEPS" | awk '/^step / { print $2 }')
  qk=$(best "$qk" "$u")
  echo "round $r: small-moe $t s, with q/k norms $u s"
done
awk -v a="$own" -v b="$qk" 'BEGIN { printf "best step: small-moe %.3f s, with q/k norms %.3f s: ratio %.3f (%+.1f%%)\n", a, b, b / a, 100 * (b / a - 1) }'
