#!/usr/bin/env bash
# `convert --format dcp` / `--format torch_dist` benchmark: writes an example checkpoint (>= 2
# GiB with its AdamW states) at tp=2,ep=4, then in one run times
#   - `reshard convert SRC --to fsdp=4 --format dcp` (a PyTorch DCP directory at another layout),
#   - `cp -r` + `sync` of the DCP directory it wrote (the same bytes),
#   - PyTorch's own reshard of that DCP directory: dcp.load into DTensors on 2 gloo processes
#     (Shard(0)) + dcp.save to a new directory (bench/dcp_torch_reshard.py; skipped without a
#     Python that has torch: set RS_TORCH_PYTHON),
#   - the same three for `--format torch_dist` (a Megatron-Core checkpoint; PyTorch's reshard
#     of it is the same dcp.load + dcp.save of its keys, with metadata.json and common.pt
#     copied beside them),
# with each command's peak RSS (GNU time: the largest process), and checks that both DCP
# directories hold the source's values (`reshard diff`, our DCP reader). Caches are not dropped.
#
# Usage: bench/dcp_write.sh [BUILD_DIR (build)] [SCRATCH (/tmp)] [N_LAYERS (4)]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
SCRATCH=${2:-/tmp}
LAYERS=${3:-4}
CLI=$BUILD/cli/reshard
PY=${RS_TORCH_PYTHON:-python3}
DIR=$(mktemp -d "$SCRATCH/rs-bench-dcp-XXXXXX")
trap 'rm -rf "$DIR"' EXIT
cat > "$DIR/model.json" <<JSON
{"name": "bench-dcp", "vocab_size": 32000, "d_model": 1024, "n_layers": $LAYERS, "n_heads": 16,
 "n_kv_heads": 8, "head_dim": 64, "n_experts": 8, "top_k": 2, "moe_ffn": 1024, "max_seq_len": 256}
JSON
"$CLI" example --model "$DIR/model.json" --layout tp=2,ep=4 -o "$DIR/src" >/dev/null
size() { du -sb "$1" | cut -f1; }
gib() { awk -v b="$1" 'BEGIN { printf "%.2f GiB", b / 1073741824 }'; }
timed() {
  /usr/bin/time -f "%e %M" -o "$DIR/time" "$@" >"$DIR/out" 2>"$DIR/err" || { cat "$DIR/err" >&2; exit 1; }
  cat "$DIR/time"
}
cp_sync() { cp -r "$1" "$2" && sync; }
export -f cp_sync

echo "checkpoint: $(gib "$(size "$DIR/src")") at tp=2,ep=4 ($LAYERS layers, d_model 1024, 8 experts of 1024, vocab 32000)"
read -r t_ours rss_ours < <(timed "$CLI" convert "$DIR/src" --to fsdp=4 --format dcp --memory-budget 256MiB -o "$DIR/dcp")
sync
read -r t_cp _ < <(timed bash -c "cp_sync '$DIR/dcp' '$DIR/dcp-copy'")
rm -rf "$DIR/dcp-copy"
"$CLI" diff "$DIR/src" "$DIR/dcp" >/dev/null && ours_same="identical" || ours_same="DIFFERENT"

printf '\n%-52s %8s %10s %10s %10s\n' operation seconds written "vs cp -r" "peak RSS"
printf '%-52s %8.2f %10s %10s %10s\n' "cp -r + sync of the DCP directory" "$t_cp" "$(gib "$(size "$DIR/dcp")")" 1.00x -
printf '%-52s %8.2f %10s %9.2fx %7d MiB\n' "convert --to fsdp=4 --format dcp (budget 256MiB)" "$t_ours" \
  "$(gib "$(size "$DIR/dcp")")" "$(awk -v a="$t_cp" -v b="$t_ours" 'BEGIN { print a / b }')" $((rss_ours / 1024))
if "$PY" -c 'import torch' 2>/dev/null; then
  read -r t_torch rss_torch < <(timed "$PY" bench/dcp_torch_reshard.py "$DIR/dcp" "$DIR/torch" --procs 2)
  read -r t_load t_save < "$DIR/out"
  "$CLI" diff "$DIR/src" "$DIR/torch" >/dev/null && torch_same="identical" || torch_same="DIFFERENT"
  printf '%-52s %8.2f %10s %9.2fx %7d MiB\n' "PyTorch dcp.load + dcp.save, 2 gloo processes" "$t_torch" \
    "$(gib "$(size "$DIR/torch")")" "$(awk -v a="$t_cp" -v b="$t_torch" 'BEGIN { print a / b }')" $((rss_torch / 1024))
  printf '  (of which load %.2f s, save %.2f s; process start-up and imports the rest)\n' "$t_load" "$t_save"
  echo "values: ours $ours_same to the source; PyTorch's reshard $torch_same"
else
  echo "values: ours $ours_same to the source; PyTorch not run (no torch in $PY; set RS_TORCH_PYTHON)"
fi

# Megatron-Core torch_dist: the same plan under Megatron's keys, plus metadata.json and common.pt.
read -r t_td rss_td < <(timed "$CLI" convert "$DIR/src" --to fsdp=4 --format torch_dist --memory-budget 256MiB -o "$DIR/td")
sync
read -r t_cp_td _ < <(timed bash -c "cp_sync '$DIR/td' '$DIR/td-copy'")
rm -rf "$DIR/td-copy"
"$CLI" diff "$DIR/src" "$DIR/td" >/dev/null && td_same="identical" || td_same="DIFFERENT"
printf '\n%-52s %8s %10s %10s %10s\n' operation seconds written "vs cp -r" "peak RSS"
printf '%-52s %8.2f %10s %10s %10s\n' "cp -r + sync of the torch_dist directory" "$t_cp_td" "$(gib "$(size "$DIR/td")")" 1.00x -
printf '%-52s %8.2f %10s %9.2fx %7d MiB\n' "convert --to fsdp=4 --format torch_dist" "$t_td" \
  "$(gib "$(size "$DIR/td")")" "$(awk -v a="$t_cp_td" -v b="$t_td" 'BEGIN { print a / b }')" $((rss_td / 1024))
if "$PY" -c 'import torch' 2>/dev/null; then
  rm -rf "$DIR/torch"
  read -r t_torch rss_torch < <(timed "$PY" bench/dcp_torch_reshard.py "$DIR/td" "$DIR/torch-td" --procs 2)
  read -r t_load t_save < "$DIR/out"
  cp "$DIR/td/metadata.json" "$DIR/td/common.pt" "$DIR/torch-td/"
  "$CLI" diff "$DIR/src" "$DIR/torch-td" >"$DIR/diff" 2>&1 && torch_same="identical" ||
    torch_same="DIFFERENT: $(tail -3 "$DIR/diff")"
  printf '%-52s %8.2f %10s %9.2fx %7d MiB\n' "PyTorch dcp.load + dcp.save, 2 gloo processes" "$t_torch" \
    "$(gib "$(size "$DIR/torch-td")")" "$(awk -v a="$t_cp_td" -v b="$t_torch" 'BEGIN { print a / b }')" \
    $((rss_torch / 1024))
  printf '  (of which load %.2f s, save %.2f s; process start-up and imports the rest)\n' "$t_load" "$t_save"
  echo "values: ours $td_same to the source; PyTorch's reshard $torch_same"
else
  echo "values: ours $td_same to the source; PyTorch not run (no torch in $PY; set RS_TORCH_PYTHON)"
fi
