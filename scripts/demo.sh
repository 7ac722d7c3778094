#!/usr/bin/env bash
# The main job on the built-in default: train the tiny MoE on the GPL-3 text for 300 steps
# (JSON log and TensorBoard events), checkpoint it, verify and inspect the checkpoint, evaluate
# it, draw its training curves, and write an example checkpoint at a sharded layout next to it
# with a picture of one fused tensor's shards.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build
BIN=build/cli/reshard
OUT=${OUT:-out}
rm -rf "$OUT"
mkdir -p "$OUT"
"$BIN" train --model tiny-moe --steps 300 --save "$OUT/tiny-moe" --log "$OUT/train.jsonl" --tensorboard "$OUT/tb"
CKPT="$OUT/tiny-moe/step-00000300"   # train --save DIR writes DIR/step-NNNNNNNN
"$BIN" verify "$CKPT"
"$BIN" inspect "$CKPT"
"$BIN" eval "$CKPT" --windows 64
"$BIN" plot "$OUT/train.jsonl" --svg "$OUT/curves.svg"   # or: tensorboard --logdir "$OUT/tb"
"$BIN" example --model tiny-moe --layout tp=2,ep=2,fsdp=2 --seed 1 --codec zstd -o "$OUT/example"
"$BIN" verify "$OUT/example"
"$BIN" inspect "$OUT/example" --tensor layers.0.moe.experts.fc1.weight --svg "$OUT/fc1-shards.svg"
