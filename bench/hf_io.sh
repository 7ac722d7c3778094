#!/usr/bin/env bash
# Hugging Face export / import benchmark: writes an example checkpoint of a Mixtral- or
# Qwen3-MoE-shaped model
# (>= 2 GiB with its AdamW states) at tp=2,ep=4, then times `reshard export --format hf` and
# `reshard import --format hf` (back to tp=2,ep=4 under --memory-budget 256MiB) against `cp -r`
# + `sync` of the bytes each one writes, in the same run, and reports each command's peak RSS
# (GNU time). Caches are not dropped: sources may come from the page cache for cp and us alike.
#
# Usage: bench/hf_io.sh [BUILD_DIR (build)] [SCRATCH (/tmp)] [N_LAYERS (4)] [FAMILY (mixtral|qwen3_moe)]
# qwen3_moe adds per-head q/k norms, a dense first layer (mlp_only_layers) and writes the
# Qwen3-MoE names and config.json.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
SCRATCH=${2:-/tmp}
LAYERS=${3:-4}
FAMILY=${4:-mixtral}
case "$FAMILY" in
  mixtral) EXTRA='"router": "topk"' ;;
  qwen3_moe) EXTRA='"router": "topk", "family": "qwen3_moe", "qk_norm": true, "dense_layers": [0], "dense_ffn": 2048' ;;
  *) echo "bench/hf_io.sh: unknown family '$FAMILY' (mixtral or qwen3_moe)" >&2; exit 2 ;;
esac
CLI=$BUILD/cli/reshard
DIR=$(mktemp -d "$SCRATCH/rs-bench-hf-XXXXXX")
trap 'rm -rf "$DIR"' EXIT
cat > "$DIR/model.json" <<JSON
{"name": "bench-$FAMILY", "vocab_size": 32000, "d_model": 1024, "n_layers": $LAYERS, "n_heads": 16,
 "n_kv_heads": 8, "head_dim": 64, "n_experts": 8, "top_k": 2, "moe_ffn": 1024, "max_seq_len": 256,
 $EXTRA}
JSON
"$CLI" example --model "$DIR/model.json" --layout tp=2,ep=4 -o "$DIR/src" >/dev/null
size() { du -sb "$1" | cut -f1; }
gib() { awk -v b="$1" 'BEGIN { printf "%.2f GiB", b / 1073741824 }'; }
# Runs a command under GNU time; prints "seconds peak_kib".
timed() {
  /usr/bin/time -f "%e %M" -o "$DIR/time" "$@" >/dev/null 2>"$DIR/err" || { cat "$DIR/err" >&2; exit 1; }
  cat "$DIR/time"
}
cp_sync() { cp -r "$1" "$2" && sync; }
export -f cp_sync

echo "checkpoint ($FAMILY): $(gib "$(size "$DIR/src")") at tp=2,ep=4 ($LAYERS layers, d_model 1024, 8 experts of 1024, vocab 32000)"
read -r t_exp rss_exp < <(timed "$CLI" export "$DIR/src" --format hf --memory-budget 256MiB -o "$DIR/hf")
read -r t_cp1 _ < <(timed bash -c "cp_sync '$DIR/hf' '$DIR/hf-copy'")
read -r t_imp rss_imp < <(timed "$CLI" import "$DIR/hf" --format hf --layout tp=2,ep=4 --memory-budget 256MiB \
  -o "$DIR/imp")
read -r t_cp2 _ < <(timed bash -c "cp_sync '$DIR/imp' '$DIR/imp-copy'")
"$CLI" diff "$DIR/src" "$DIR/imp" --role parameter >/dev/null && same="identical parameters" || same="PARAMETERS DIFFER"

printf '\n%-46s %8s %10s %10s %10s\n' operation seconds written "vs cp -r" "peak RSS"
printf '%-46s %8.2f %10s %10s %10s\n' "cp -r + sync of the HF directory" "$t_cp1" "$(gib "$(size "$DIR/hf")")" 1.00x -
printf '%-46s %8.2f %10s %9.2fx %7d MiB\n' "export --format hf (--memory-budget 256MiB)" "$t_exp" "$(gib "$(size "$DIR/hf")")" \
  "$(awk -v a="$t_cp1" -v b="$t_exp" 'BEGIN { print a / b }')" $((rss_exp / 1024))
printf '%-46s %8.2f %10s %10s %10s\n' "cp -r + sync of the imported checkpoint" "$t_cp2" "$(gib "$(size "$DIR/imp")")" 1.00x -
printf '%-46s %8.2f %10s %9.2fx %7d MiB\n' "import --format hf (--memory-budget 256MiB)" "$t_imp" \
  "$(gib "$(size "$DIR/imp")")" "$(awk -v a="$t_cp2" -v b="$t_imp" 'BEGIN { print a / b }')" $((rss_imp / 1024))
echo "round trip: $same"
