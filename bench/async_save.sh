#!/usr/bin/env bash
# Checkpointing that does not stop training, measured in one run: `reshard train` without saves,
# with synchronous saves and with --async-save (a save every K steps; the last step always
# saves), at each process count. Prints, per process count:
#   - the time the step loop was blocked per save (what `train` reports: snapshot, commit,
#     back-pressure; the async end-of-run wait for the last save is shown apart), and the async
#     stall as a fraction of the synchronous one (target <= 1/20);
#   - the training time (steps + blocked time, end-of-run wait excluded) against the run without
#     saves (target: <= 5 % overhead). On a 2-core machine the background writer competes with
#     the training threads for the cores; that cost is in the step times, reported as measured;
#   - the same async run with --buffered-writes (data through the page cache instead of
#     O_DIRECT): the kernel's copying and write-back is CPU the writer takes from training;
#   - a second table of the same runs without each run's first step, whose time varies by a
#     factor of two from run to run with or without saves (first-touch memory), from the
#     runs' --log files.
#
# Usage: bench/async_save.sh [BUILD_DIR] [MODEL] [STEPS] [EVERY] [NPS]
#        (default: build small-moe 20 10 "1 2": a save every 10 steps, as the target is set)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
MODEL=${2:-small-moe}
STEPS=${3:-20}
EVERY=${4:-10}
NPS=${5:-"1 2"}
R=$(realpath "$BUILD/cli/reshard")
T=$(mktemp -d /tmp/rs-async-bench-XXXXXX)
trap 'rm -rf "$T"' EXIT

# The summary numbers of one run: step seconds, blocked seconds in the loop, end wait, and the
# first step's seconds.
run() {  # np mode
  local np=$1 mode=$2 out="$T/run-$1-$2" log="$T/log-$1-$2" jsonl="$T/jsonl-$1-$2" launcher=() flags=() layout=()
  [ "$np" -gt 1 ] && launcher=(mpirun --oversubscribe --allow-run-as-root -np "$np") && layout=(--layout "fsdp=$np")
  case "$mode" in
    none) ;;
    sync) flags=(--save "$out" --save-every "$EVERY") ;;
    async) flags=(--save "$out" --save-every "$EVERY" --async-save) ;;
    async-buffered) flags=(--save "$out" --save-every "$EVERY" --async-save --buffered-writes) ;;
  esac
  "${launcher[@]}" "$R" train --model "$MODEL" --steps "$STEPS" --threads "$(( 2 / np > 0 ? 2 / np : 1 ))" \
    "${layout[@]}" "${flags[@]}" --log "$jsonl" >"$log" 2>&1
  local steps blocked fence end first
  steps=$(sed -n 's/^steps [0-9.]* in \([0-9.]*\) s.*/\1/p' "$log")
  blocked=$(sed -n 's/.*the step loop was blocked \([0-9.]*\) s by them.*/\1/p' "$log")
  # Updates waiting for a snapshot's background copy: blocked time that is inside the steps'.
  fence=$(sed -n 's/.*of which \([0-9.]*\) s inside steps.*/\1/p' "$log")
  end=$(sed -n 's/.*and \([0-9.]*\) s at the end for the last one.*/\1/p' "$log")
  steps=$(awk -v s="${steps:-0}" -v f="${fence:-0}" 'BEGIN { print s - f }')
  # The first line of the JSON log is the first step; its "seconds" field (not comm_seconds...).
  first=$(head -n 1 "$jsonl" | grep -o '[{,]"seconds":[0-9.eE+-]*' | sed 's/.*://')
  echo "${steps:-0} ${blocked:-0} ${end:-0} ${first:-0}"
}

echo "reshard train --model $MODEL --steps $STEPS, a save every $EVERY steps ($(nproc) cores)"
printf '| np | saves | sync: blocked per save | async: blocked per save | async / sync | no saves: train s | sync: train s (ratio) | async: train s (ratio) | async: end wait | async, buffered writes: train s (ratio) |\n'
printf '|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n'
saves=$(( STEPS / EVERY + (STEPS % EVERY > 0 ? 1 : 0) ))
steady=()
for np in $NPS; do
  # The run without saves twice, first and last (the machines are shared: a slow neighbour
  # during one run would otherwise pass for an overhead or a gain); the faster one counts.
  read -r s0 _ _ f0 < <(run "$np" none)
  read -r s1 b1 _ f1 < <(run "$np" sync)
  read -r s2 b2 e2 f2 < <(run "$np" async)
  read -r s4 b4 _ f4 < <(run "$np" async-buffered)
  read -r s3 _ _ f3 < <(run "$np" none)
  steady+=("$(awk -v np="$np" -v a="$s0" -v fa="$f0" -v c="$s3" -v fc="$f3" -v s1="$s1" -v b1="$b1" -v f1="$f1" \
    -v s2="$s2" -v b2="$b2" -v f2="$f2" -v s4="$s4" -v b4="$b4" -v f4="$f4" 'BEGIN {
    z = (a - fa < c - fc ? a - fa : c - fc)
    printf "| %d | %.1f | %.1f (%.3f) | %.1f (%.3f) | %.1f (%.3f) |", np, z, s1 - f1 + b1, (s1 - f1 + b1) / z,
      s2 - f2 + b2, (s2 - f2 + b2) / z, s4 - f4 + b4, (s4 - f4 + b4) / z }')")
  s0=$(awk -v a="$s0" -v b="$s3" 'BEGIN { print (a < b ? a : b) }')
  awk -v np="$np" -v n="$saves" -v s0="$s0" -v s1="$s1" -v b1="$b1" -v s2="$s2" -v b2="$b2" -v e2="$e2" -v s4="$s4" -v b4="$b4" 'BEGIN {
    printf "| %d | %d | %.3f s | %.3f s | %.3f | %.1f | %.1f (%.3f) | %.1f (%.3f) | %.2f s | %.1f (%.3f) |\n",
      np, n, b1 / n, b2 / n, (b1 > 0 ? b2 / b1 : 0), s0, s1 + b1, (s1 + b1) / s0, s2 + b2, (s2 + b2) / s0, e2,
      s4 + b4, (s4 + b4) / s0 }'
done
echo
echo "Without each run's first step (steps 2..$STEPS plus the blocked time):"
printf '| np | no saves: train s | sync: train s (ratio) | async: train s (ratio) | async, buffered writes: train s (ratio) |\n'
printf '|---:|---:|---:|---:|---:|\n'
printf '%s\n' "${steady[@]}"
