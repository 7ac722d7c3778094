#!/usr/bin/env bash
# The pipeline schedule measured (bench_pipeline, one process per stage under mpirun): idle
# fraction per stage against the analytic bubble for 1F1B at P = 2, 4 and M = 4, 8, 16 and
# interleaved (V = 2) at P = 2; then stage 0's memory under 1F1B against all forwards before
# all backwards (afab) at P = 2, M = 16. One OpenBLAS thread per process.
#
#   bash bench/pipeline.sh [BUILD_DIR] [MODEL] [ROWS] [SEQ]   defaults: build bench/models/pipeline-8l.json 2 128
#
# On a machine with fewer cores than processes (P = 4 here on 2 cores) the stages share cores,
# so the measured idle includes waiting for a core as well as the schedule's bubble.
set -euo pipefail
build=${1:-build}
model=${2:-$(dirname "$0")/models/pipeline-8l.json}
rows=${3:-2}
seq=${4:-128}
bench="$build/bench/bench_pipeline"
run() {  # P M V schedule [rows seq]
  OPENBLAS_NUM_THREADS=1 mpirun --oversubscribe --allow-run-as-root -x OPENBLAS_NUM_THREADS -np "$1" \
    "$bench" "$2" "$3" "$4" 3 "$model" "${5:-$rows}" "${6:-$seq}" | grep -v -i "openblas\|kernels"
}
for p in 2 4; do
  for m in 4 8 16; do run "$p" "$m" 1 1f1b; done
done
for m in 4 8 16; do run 2 "$m" 2 1f1b; done
# Memory: activations dominate with longer micro-batches.
run 2 16 1 1f1b 4 256
run 2 16 1 afab 4 256
