#!/usr/bin/env bash
# Save and load throughput of training checkpoints against `cp -r` + `sync` of the same bytes,
# and what a resume at another layout reads, in one run:
#   1. `train` at tp=2,ep=4,fsdp=2 (16 ranks) for one step with a synchronous save: the time
#      the step loop was blocked by the save (serialise, checksum, write, fsync, commit);
#   2. `train --resume` of that checkpoint at tp=4,dp=2 (8 ranks), one step, saved again: the
#      load's time (the slowest rank's), the read amplification (bytes all ranks read against
#      the checkpoint's data files), the bytes each rank read, and the second save's time;
#   3. `cp -r` + `sync` of each checkpoint directory (the page cache dropped first where the
#      machine allows it, as before each load), the baseline of both.
# One process per rank: on a machine with fewer cores they are oversubscribed, which slows the
# steps, not the file work measured here (each rank writes and reads its own files).
#
# Usage: bench/save_load.sh [BUILD_DIR] [MODEL_JSON]
#        (default model: 37M parameters, 8 experts, a checkpoint of about 0.45 GiB)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
R=$(realpath "$BUILD/cli/reshard")
T=$(mktemp -d /tmp/rs-save-load-XXXXXX)
trap 'rm -rf "$T"' EXIT
MODEL=${2:-$T/model.json}
if [ -z "${2:-}" ]; then
  cat > "$MODEL" <<'EOF'
{"name": "save-load", "vocab_size": 8192, "d_model": 512, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4,
 "head_dim": 64, "n_experts": 8, "top_k": 2, "moe_ffn": 512, "max_seq_len": 64}
EOF
fi
MPI=(mpirun --oversubscribe)
[ "$(id -u)" -eq 0 ] && MPI+=(--allow-run-as-root)

drop_caches() {  # 0 when the page cache could be dropped
  sync
  { echo 3 > /proc/sys/vm/drop_caches; } 2>/dev/null
}
now() { date +%s.%N; }
bytes_of() { du -sb "$1" | cut -f1; }
# Seconds of `cp -r SRC DST` + `sync`, from a cold page cache where possible.
cp_seconds() {
  drop_caches || true
  local t0 t1
  t0=$(now)
  cp -r "$1" "$2"
  sync
  t1=$(now)
  rm -rf "$2"
  echo "$t1 - $t0" | bc -l
}
# The "blocked X s" of a train run's checkpoint line.
blocked() { sed -n 's/.*the step loop was blocked \([0-9.]*\) s by them.*/\1/p' "$1" | head -1; }

cold="no"
drop_caches && cold="yes"
echo "page cache dropped before each load and copy: $cold"

echo "1. train at tp=2,ep=4,fsdp=2 (16 ranks), one step, synchronous save" >&2
"${MPI[@]}" -np 16 "$R" train --model "$MODEL" --layout tp=2,ep=4,fsdp=2 --steps 1 --threads 1 --batch-size 16 \
  --save "$T/a" 2> "$T/a.log" || { cat "$T/a.log"; exit 1; }
SRC="$T/a/step-00000001"
save1=$(blocked "$T/a.log")
bytes1=$(bytes_of "$SRC")

echo "2. resume at tp=4,dp=2 (8 ranks), one step, synchronous save" >&2
drop_caches || true
"${MPI[@]}" -np 8 "$R" train --resume "$SRC" --layout tp=4,dp=2 --steps 2 --threads 1 --save "$T/b" \
  2> "$T/b.log" || { cat "$T/b.log"; exit 1; }
DST="$T/b/step-00000002"
save2=$(blocked "$T/b.log")
bytes2=$(bytes_of "$DST")
resumed=$(grep "^resumed " "$T/b.log")
load=$(echo "$resumed" | sed -n 's/.* in \([0-9.]*\) s .*/\1/p')
per_rank=$(sed -n 's/^read per rank: //p' "$T/b.log")

echo "3. cp -r + sync of both checkpoints" >&2
cp1=$(cp_seconds "$SRC" "$T/copy1")
cp2=$(cp_seconds "$DST" "$T/copy2")

mib() { echo "$1 / 1048576" | bc -l; }
printf '\n| what | bytes | seconds | MiB/s | cp -r + sync: seconds | MiB/s | ratio (ours / cp) |\n|---|---:|---:|---:|---:|---:|---:|\n'
row() {  # label bytes seconds cp_seconds
  printf '| %s | %.0f MiB | %.2f | %.0f | %.2f | %.0f | %.2f |\n' "$1" "$(mib "$2")" "$3" \
    "$(echo "$(mib "$2") / $3" | bc -l)" "$4" "$(echo "$(mib "$2") / $4" | bc -l)" "$(echo "$4 / $3" | bc -l)"
}
row "save, tp=2,ep=4,fsdp=2 (16 ranks)" "$bytes1" "$save1" "$cp1"
row "load of it at tp=4,dp=2 (8 ranks)" "$bytes1" "$load" "$cp1"
row "save, tp=4,dp=2 (8 ranks)" "$bytes2" "$save2" "$cp2"
echo
echo "$resumed"
echo "read per rank (tp=4,dp=2; the first rank of each data-parallel group reads, the second receives): $per_rank"
