#!/usr/bin/env bash
# Scaling of `reshard train --device cuda` over the GPUs of one host: the same global batch on
# 1 GPU and on N ranks (`--layout dp=N`, fsdp=N, ep=N: experts cut over the ranks, rows
# exchanged by all-to-all; small-moe's 16 experts, N dividing 16; and tp=N: heads, ffn widths
# and vocab cut over the ranks, which all run the same rows), bf16 small-moe. Prints
# each run's summary line (rank 0's GPU: ms per step, TFLOP/s of model products of its rows)
# and the tokens/s of the whole run from the wall time, so the scaling efficiency is
# tokens/s(N) / (N · tokens/s(1)) with both measured in the same invocation.
#
# Usage: bench/train_multi_gpu.sh BUILD_DIR [RANKS] [STEPS] [nccl|host]
#   nccl (default) needs RANKS GPUs; host stages collectives through host memory and MPI (ranks
#   may share a GPU – a functional check, not a scaling measurement).
set -euo pipefail
cli="$1/cli/reshard"
ranks="${2:-2}"
steps="${3:-20}"
comm="${4:-nccl}"
batch=$((16 * ranks))
args=(--model small-moe --precision bf16 --batch-size "$batch" --seq-len 256 --steps "$steps")
tokens=$((batch * 256 * steps))
run() {
  local np="$1"
  shift
  echo "== ranks $np: $*"
  local start end
  start=$(date +%s.%N)
  if [ "$np" = 1 ]; then
    "$cli" train --device cuda "${args[@]}" "$@" 2>&1 | grep -E "^(cuda|steps)" || return 1
  else
    mpirun --oversubscribe --allow-run-as-root -np "$np" "$cli" train --device cuda --device-comm "$comm" "${args[@]}" \
      "$@" 2>&1 | grep -E "^(cuda|steps)" || return 1
  fi
  end=$(date +%s.%N)
  awk -v t="$tokens" -v a="$start" -v b="$end" 'BEGIN { printf "whole run: %.0f tokens/s (%.1f s, start-up included)\n", t / (b - a), b - a }'
}
run 1
run "$ranks" --layout "dp=$ranks"
run "$ranks" --layout "fsdp=$ranks"
run "$ranks" --layout "ep=$ranks"
run "$ranks" --layout "tp=$ranks"
