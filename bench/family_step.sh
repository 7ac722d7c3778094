#!/usr/bin/env bash
# Another family's CPU training step against the own model at (nearly) equal parameters:
# bench_train_step (best step of STEPS) of the small-moe preset (GQA, 16 experts top-2, 107.3M
# parameters) and of MODEL, run alternately ROUNDS times in one run on the same machine. Prints
# each run, the best step times, tokens/s and their ratio, and each model's phase shares.
#   bench/models/deepseek-small.json (default): multi-latent attention with a query bottleneck, a
#     dense first layer, 15 experts top-2 in 3 groups of which 2 are kept, one shared expert:
#     106.9M parameters, more of them active per token.
#   bench/models/qwen3-next-small.json: 6 gated-delta-net and 2 gated full-attention layers
#     (partial rotary, zero-centred norms), 15 experts top-2 and a gated shared expert.
#
# Usage: bench/family_step.sh [BUILD_DIR (build)] [ROUNDS (2)] [BATCH (4)] [SEQ (128)] [STEPS (3)] [MODEL]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
ROUNDS=${2:-2}
BATCH=${3:-4}
SEQ=${4:-128}
STEPS=${5:-3}
MODEL=${6:-bench/models/deepseek-small.json}
NAME=$(basename "$MODEL" .json)
BIN=$BUILD/bench/bench_train_step
best() { awk -v a="$1" -v b="$2" 'BEGIN { print (a == "" || b < a) ? b : a }'; }
own="" other="" own_log="" other_log=""
for r in $(seq "$ROUNDS"); do
  out=$("$BIN" small-moe "$BATCH" "$SEQ" "$STEPS")
  t=$(awk '/^step / { print $2 }' <<<"$out")
  [ -z "$own" ] || awk -v a="$own" -v b="$t" 'BEGIN { exit !(b < a) }' && own_log=$out
  own=$(best "$own" "$t")
  out=$("$BIN" "$MODEL" "$BATCH" "$SEQ" "$STEPS")
  u=$(awk '/^step / { print $2 }' <<<"$out")
  [ -z "$other" ] || awk -v a="$other" -v b="$u" 'BEGIN { exit !(b < a) }' && other_log=$out
  other=$(best "$other" "$u")
  echo "round $r: small-moe $t s, $NAME $u s"
done
echo "--- small-moe (best run)"; grep -E "parameters|^step|^phases" <<<"$own_log"
echo "--- $NAME (best run)"; grep -E "parameters|^step|^phases" <<<"$other_log"
awk -v a="$own" -v b="$other" -v n="$NAME" 'BEGIN { printf "best step: small-moe %.3f s, %s %.3f s: ratio %.3f\n", a, n, b, b / a }'
