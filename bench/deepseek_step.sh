#!/usr/bin/env bash
# A DeepSeek-V3-shaped CPU training step against the own model at (nearly) equal parameters:
# bench_train_step (best step of STEPS) of the small-moe preset (GQA, 16 experts top-2, 107.3M
# parameters) and of bench/models/deepseek-small.json (multi-latent attention with a query
# bottleneck, a dense first layer, 15 experts top-2 in 3 groups of which 2 are kept, one shared
# expert: 106.9M parameters, more of them active per token), run alternately ROUNDS times in one
# run on the same machine. Prints each run, the best step times, tokens/s and their ratio, and
# each model's phase shares (attention is where MLA differs).
#
# Usage: bench/deepseek_step.sh [BUILD_DIR (build)] [ROUNDS (2)] [BATCH (4)] [SEQ (128)] [STEPS (3)]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
ROUNDS=${2:-2}
BATCH=${3:-4}
SEQ=${4:-128}
STEPS=${5:-3}
BIN=$BUILD/bench/bench_train_step
DS=bench/models/deepseek-small.json
best() { awk -v a="$1" -v b="$2" 'BEGIN { print (a == "" || b < a) ? b : a }'; }
own="" ds="" own_log="" ds_log=""
for r in $(seq "$ROUNDS"); do
  out=$("$BIN" small-moe "$BATCH" "$SEQ" "$STEPS")
  t=$(awk '/^step / { print $2 }' <<<"$out")
  [ -z "$own" ] || awk -v a="$own" -v b="$t" 'BEGIN { exit !(b < a) }' && own_log=$out
  own=$(best "$own" "$t")
  out=$("$BIN" "$DS" "$BATCH" "$SEQ" "$STEPS")
  u=$(awk '/^step / { print $2 }' <<<"$out")
  [ -z "$ds" ] || awk -v a="$ds" -v b="$u" 'BEGIN { exit !(b < a) }' && ds_log=$out
  ds=$(best "$ds" "$u")
  echo "round $r: small-moe $t s, deepseek-small $u s"
done
echo "--- small-moe (best run)"; grep -E "parameters|^step|^phases" <<<"$own_log"
echo "--- deepseek-small (best run)"; grep -E "parameters|^step|^phases" <<<"$ds_log"
awk -v a="$own" -v b="$ds" 'BEGIN { printf "best step: small-moe %.3f s, deepseek-small %.3f s: ratio %.3f\n", a, b, b / a }'
