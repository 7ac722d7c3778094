#!/usr/bin/env bash
# Megatron-LM's default distributed-optimizer checkpoint (dp_reshardable, formats/torch/MEGATRON.md)
# converted to another tp / pp / ep, against `cp -r` + `sync` of the same bytes, in one run:
#   - the source: an example checkpoint (>= 2 GiB with its AdamW states) written as Megatron's
#     dp_reshardable buckets at tp=2,pp=2,ep=2 (8 ranks: dp 2, expert dp 2) by our writer, or
#     the directory MEGATRON_DP_CHECKPOINT names (e.g. one made by megatron-core itself:
#     MEGATRON_BENCH=1 python3 tests/fixtures/megatron/make_dp_reshardable.py DIR, 2.7 GiB);
#   - `reshard convert SRC --to tp=1,ep=4` (our format, every master and moment placed from the
#     reconstructed buckets) with a 256 MiB memory budget, and `--format torch_dist
#     --megatron-optimizer dp_reshardable` at tp=4,ep=2 (the target run's buckets);
#   - `cp -r` + `sync` of the source directory.
# Prints seconds, the ratio to cp -r, and each command's peak RSS (GNU time), and checks the
# values (`reshard diff` against the source). Caches are not dropped.
#
# Usage: bench/megatron_dp_reshardable.sh [BUILD_DIR (build)] [SCRATCH (/tmp)] [N_LAYERS (4)]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
SCRATCH=${2:-/tmp}
LAYERS=${3:-4}
CLI=$BUILD/cli/reshard
DIR=$(mktemp -d "$SCRATCH/rs-bench-mdp-XXXXXX")
trap 'rm -rf "$DIR"' EXIT
size() { du -sb "$1" | cut -f1; }
gib() { awk -v b="$1" 'BEGIN { printf "%.2f GiB", b / 1073741824 }'; }
timed() {
  /usr/bin/time -f "%e %M" -o "$DIR/time" "$@" >"$DIR/out" 2>"$DIR/err" || { cat "$DIR/err" >&2; exit 1; }
  cat "$DIR/time"
}
cp_sync() { cp -r "$1" "$2" && sync; }
export -f cp_sync

if [ -n "${MEGATRON_DP_CHECKPOINT:-}" ]; then
  SRC=$MEGATRON_DP_CHECKPOINT
  echo "source: $SRC ($(gib "$(size "$SRC")"), as given)"
else
  cat > "$DIR/model.json" <<JSON
{"name": "bench-mdp", "vocab_size": 32000, "d_model": 1024, "n_layers": $LAYERS, "n_heads": 16,
 "n_kv_heads": 8, "head_dim": 64, "n_experts": 8, "top_k": 2, "moe_ffn": 1024, "max_seq_len": 256}
JSON
  "$CLI" example --model "$DIR/model.json" --layout tp=2,ep=4 -o "$DIR/ours" >/dev/null
  SRC=$DIR/src
  read -r t_w rss_w < <(timed "$CLI" convert "$DIR/ours" --to tp=2,pp=2,ep=2 --format torch_dist \
    --megatron-spec local --megatron-optimizer dp_reshardable --memory-budget 256MiB -o "$SRC")
  echo "source: $(gib "$(size "$SRC")") of dp_reshardable buckets at tp=2,pp=2,ep=2 ($LAYERS layers, d_model 1024," \
    "8 experts of 1024, vocab 32000), written by us in ${t_w} s, peak RSS $((rss_w / 1024)) MiB"
fi
sync
read -r t_cp _ < <(timed bash -c "cp_sync '$SRC' '$DIR/copy'")
rm -rf "$DIR/copy"
read -r t_ours rss_ours < <(timed "$CLI" convert "$SRC" --to tp=1,ep=4 --memory-budget 256MiB -o "$DIR/tp1")
sync
read -r t_td rss_td < <(timed "$CLI" convert "$SRC" --to tp=4,ep=2 --format torch_dist \
  --megatron-optimizer dp_reshardable --memory-budget 256MiB -o "$DIR/td")
sync
printf '\n%-62s %8s %10s %10s %10s\n' operation seconds written "vs cp -r" "peak RSS"
printf '%-62s %8.2f %10s %10s %10s\n' "cp -r + sync of the source" "$t_cp" "$(gib "$(size "$SRC")")" 1.00x -
printf '%-62s %8.2f %10s %9.2fx %7d MiB\n' "convert --to tp=1,ep=4 (ours; budget 256MiB)" "$t_ours" \
  "$(gib "$(size "$DIR/tp1")")" "$(awk -v a="$t_cp" -v b="$t_ours" 'BEGIN { print a / b }')" $((rss_ours / 1024))
printf '%-62s %8.2f %10s %9.2fx %7d MiB\n' "convert --to tp=4,ep=2 --format torch_dist (dp_reshardable)" "$t_td" \
  "$(gib "$(size "$DIR/td")")" "$(awk -v a="$t_cp" -v b="$t_td" 'BEGIN { print a / b }')" $((rss_td / 1024))
"$CLI" diff "$SRC" "$DIR/tp1" >/dev/null && a="identical" || a="DIFFERENT"
"$CLI" diff "$DIR/tp1" "$DIR/td" >/dev/null && b="identical" || b="DIFFERENT"
echo "values: tp=1,ep=4 $a to the source; the dp_reshardable rewrite $b to it"
