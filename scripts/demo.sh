#!/usr/bin/env bash
# The main job on the built-in default: train the tiny MoE on the GPL-3 text for 300 steps,
# checkpoint it, verify and inspect the checkpoint, evaluate it, and write an example
# checkpoint at a sharded layout next to it.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build
BIN=build/cli/reshard
OUT=${OUT:-out}
rm -rf "$OUT"
mkdir -p "$OUT"
"$BIN" train --model tiny-moe --steps 300 --save "$OUT/tiny-moe" --log "$OUT/train.jsonl"
CKPT="$OUT/tiny-moe/step-00000300"   # train --save DIR writes DIR/step-NNNNNNNN
"$BIN" verify "$CKPT"
"$BIN" inspect "$CKPT"
"$BIN" eval "$CKPT" --windows 64
"$BIN" example --model tiny-moe --layout tp=2,ep=2,fsdp=2 --seed 1 --codec zstd -o "$OUT/example"
"$BIN" verify "$OUT/example"
