#!/usr/bin/env bash
# Real-run scale: checkpoints with tens of thousands to millions of shards, measured in one run.
#
#   bash bench/many_shards.sh BUILD_DIR SCRATCH_DIR [--large]
#
# With bytes (a DeepSeek-V3-shaped model of 61 layers and 256 experts with tiny dimensions, so
# that only the per-shard costs show): `example` at pp=4,ep=64 (256 ranks, 32.7k shards), then
#   - `cp -r` + `sync` of it: the baseline;
#   - `convert` to pp=8,ep=32,tp=2 (512 ranks, 49.2k shards) at --memory-budget 128MiB;
#   - `verify` of the result, `plan` of the source, `inspect`.
# --large adds the same model at pp=16,ep=64,dp=2 with replicas (2,048 ranks, 443.6k shards):
# written, planned and converted (several minutes).
# Without bytes (`example --index-only`): the full DeepSeek-V3 (bench/models/deepseek-v3-671b.json)
# at pp=16,ep=64,dp=2 and dp=8 with replicas (443.6k and 1.77M shards), planned to
# pp=8,ep=32,tp=2 and inspected.
#
# Prints seconds, peak RSS (GNU time: Debian package `time`), microseconds per shard and, where
# bytes exist, the ratio of cp's time to the command's (1.00x = as fast as cp -r + sync; the
# target is >= 0.5x for convert). Writes the figures as JSON lines (SCRATCH_DIR/many_shards.jsonl,
# one line per shard count) and draws them with `reshard plot` (SCRATCH_DIR/many_shards.svg).
set -euo pipefail
BUILD=$(cd "$1" && pwd)
SCRATCH=$2
LARGE=${3:-}
R="$BUILD/cli/reshard"
HERE=$(cd "$(dirname "$0")" && pwd)
W="$SCRATCH/many_shards"
rm -rf "$W"
mkdir -p "$W"
TIME=/usr/bin/time
[[ -x $TIME ]] || { echo "needs GNU time (apt-get install time)" >&2; exit 2; }

cat >"$W/tiny.json" <<'EOF'
{"name": "deepseek-v3-61x256-tiny", "family": "deepseek_v3", "vocab_size": 256, "d_model": 32,
 "n_layers": 61, "n_heads": 4, "n_kv_heads": 4, "head_dim": 10, "mla_q_rank": 12, "mla_kv_rank": 8,
 "mla_rope_dim": 4, "mla_v_dim": 6, "rope_interleave": true, "dense_ffn": 48, "moe_ffn": 16,
 "n_experts": 256, "top_k": 8, "shared_ffn": 16, "first_dense_layers": 3, "router": "sigmoid_bias",
 "router_grouped": true, "router_groups": 8, "router_groups_kept": 4, "router_scale": 2.5,
 "router_norm_topk": true, "norm_eps": 1e-06, "rope_theta": 5000.0, "max_seq_len": 64, "param_dtype": "f32"}
EOF

# measure NAME CMD...: sets SEC and RSS_MIB.
measure() {
  local name=$1
  shift
  sync
  if ! $TIME -f "%e %M" -o "$W/time.txt" "$@" >"$W/$name.out" 2>"$W/$name.err"; then
    echo "$name failed:" >&2
    cat "$W/$name.err" >&2
    exit 1
  fi
  read -r SEC RSS_KB <"$W/time.txt"
  RSS_MIB=$(awk -v k="$RSS_KB" 'BEGIN { printf "%.0f", k / 1024 }')
}
shards_of() { grep -o '"nbytes"' "$1/manifest.json" | wc -l; }
row() {  # operation shards seconds rss baseline_seconds
  local us ratio
  us=$(awk -v s="$3" -v n="$2" 'BEGIN { printf "%.1f", s * 1e6 / n }')
  ratio=$([[ -n $5 ]] && awk -v b="$5" -v s="$3" 'BEGIN { printf "%.2fx", b / s }' || echo "-")
  printf '| %-58s | %9s | %8.2f | %8s | %9s | %7s |\n' "$1" "$2" "$3" "$4" "$us" "$ratio"
}

echo "| operation | shards | seconds | peak RSS MiB | µs / shard | vs cp -r |"
echo "|---|---|---|---|---|---|"
: >"$W/many_shards.jsonl"

# --- with bytes -------------------------------------------------------------------------------
with_bytes() {  # label layout extra-example-flags
  local label=$1 layout=$2 flags=$3
  local src="$W/src-$label" dst="$W/dst-$label"
  measure "example-$label" "$R" example --model "$W/tiny.json" --layout "$layout" $flags -o "$src"
  local n
  n=$(shards_of "$src")
  row "example $layout $flags (write)" "$n" "$SEC" "$RSS_MIB" ""
  measure "cp-$label" bash -c "cp -r '$src' '$W/copy-$label' && sync"
  local cp=$SEC
  row "cp -r + sync of it" "$n" "$cp" "$RSS_MIB" "$cp"
  rm -rf "$W/copy-$label"
  measure "plan-$label" "$R" plan "$src" --to pp=8,ep=32,tp=2
  local plan_s=$SEC plan_rss=$RSS_MIB
  row "plan -> pp=8,ep=32,tp=2" "$n" "$SEC" "$RSS_MIB" ""
  measure "convert-$label" "$R" convert "$src" --to pp=8,ep=32,tp=2 --memory-budget 128MiB -o "$dst"
  local m
  m=$(shards_of "$dst")
  local conv_s=$SEC conv_rss=$RSS_MIB
  row "convert -> pp=8,ep=32,tp=2, --memory-budget 128MiB ($m out)" "$n" "$SEC" "$RSS_MIB" "$cp"
  grep -o 'peak buffer [^,]*, peak RSS [^,]*' "$W/convert-$label.err" | sed 's/^/    reported: /' >&2 || true
  measure "verify-$label" "$R" verify "$dst"
  row "verify of the result" "$m" "$SEC" "$RSS_MIB" ""
  local ver_s=$SEC ver_rss=$RSS_MIB
  printf '{"step": %s, "plan_seconds": %s, "plan_peak_rss_mib": %s, "convert_seconds": %s, "convert_peak_rss_mib": %s, "verify_seconds": %s, "verify_peak_rss_mib": %s, "cp_seconds": %s}\n' \
    "$n" "$plan_s" "$plan_rss" "$conv_s" "$conv_rss" "$ver_s" "$ver_rss" "$cp" >>"$W/many_shards.jsonl"
  rm -rf "$src" "$dst"
}
with_bytes small pp=4,ep=64 ""
[[ $LARGE == --large ]] && with_bytes large pp=16,ep=64,dp=2 "--with-replicas --format-version 3"

# --- without bytes: the full model ------------------------------------------------------------
for dp in 2 8; do
  idx="$W/index-dp$dp"
  measure "index-$dp" "$R" example --model "$HERE/models/deepseek-v3-671b.json" --layout "pp=16,ep=64,dp=$dp" \
    --with-replicas --index-only -o "$idx"
  n=$(shards_of "$idx")
  row "DeepSeek-V3 671B pp=16,ep=64,dp=$dp, index only (write)" "$n" "$SEC" "$RSS_MIB" ""
  measure "index-inspect-$dp" "$R" inspect "$idx"
  row "inspect" "$n" "$SEC" "$RSS_MIB" ""
  measure "index-plan-$dp" "$R" plan "$idx" --to pp=8,ep=32,tp=2
  row "plan -> pp=8,ep=32,tp=2" "$n" "$SEC" "$RSS_MIB" ""
  printf '{"step": %s, "plan_seconds": %s, "plan_peak_rss_mib": %s}\n' "$n" "$SEC" "$RSS_MIB" >>"$W/many_shards.jsonl"
  grep -E "^(bytes written|bytes read|largest shard)" "$W/index-plan-$dp.out" | sed 's/^/    /' >&2
  rm -rf "$idx"
done
sort -t: -k2 -n "$W/many_shards.jsonl" -o "$W/many_shards.jsonl"
"$R" plot "$W/many_shards.jsonl" --svg "$W/many_shards.svg" --title "reshard at real-run scale (x: shards)" >/dev/null 2>&1 &&
  echo "picture: $W/many_shards.svg" >&2 || echo "(no picture: reshard plot failed)" >&2
