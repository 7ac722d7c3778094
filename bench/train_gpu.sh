#!/usr/bin/env bash
# GPU training throughput of `reshard train --device cuda` (needs a CUDA device): small-moe and
# bench/models/moe-2b.json (1.94B parameters, 16 experts top-2; fits one 80 GB H100 with its
# f32 master weights, gradients and AdamW moments), bf16, fused against unfused MoE dispatch,
# and small-moe in f32 for reference. Prints, per run, the summary lines of `train`: tokens/s,
# model FLOP/s and their share of the device's peak, the MoE dispatch's share of the step time
# and the device memory in use.
#
# Usage: bench/train_gpu.sh BUILD_DIR [STEPS] [all|small]   (small: small-moe runs only)
set -euo pipefail
cli="$1/cli/reshard"
steps="${2:-20}"
which="${3:-all}"
here="$(cd "$(dirname "$0")" && pwd)"
run() {
  echo "== $*"
  "$cli" train --device cuda --steps "$steps" "$@" 2>&1 | grep -E "^(device|model|steps|cuda)" || {
    echo "train failed"
    return 1
  }
}
run --model small-moe --precision f32 --batch-size 16 --seq-len 256
for dispatch in fused unfused; do
  run --model small-moe --precision bf16 --batch-size 16 --seq-len 256 --dispatch "$dispatch"
done
[ "$which" = small ] && exit 0
for dispatch in fused unfused; do
  run --model "$here/models/moe-2b.json" --precision bf16 --batch-size 8 --seq-len 1024 --dispatch "$dispatch"
done
