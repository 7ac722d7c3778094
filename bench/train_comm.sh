#!/usr/bin/env bash
# Benchmark: communication bytes and step time of multi-rank training (not run by CTest).
#
# For each layout it trains MODEL (default small-moe) for STEPS steps under mpirun and prints,
# from rank 0's log, the bytes rank 0 received per step by kind (the FSDP all-gather bytes
# equal `reshard buckets`' allgather_bytes_per_rank for the TP-local f32 parameters), the step time and the share of it spent in the gradient/parameter collectives outside the model.
# Usage: bench/train_comm.sh [BUILD_DIR] [MODEL] [STEPS]
set -euo pipefail
B=${1:-build}/cli/reshard
MODEL=${2:-small-moe}
STEPS=${3:-2}
MPI="mpirun --oversubscribe --allow-run-as-root"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
run() {  # layout np
  local layout=$1 np=$2 log="$tmp/log.jsonl"
  rm -f "$log"
  if [ "$np" = 1 ]; then
    "$B" train --model "$MODEL" --steps "$STEPS" --threads 1 --layout "$layout" --log "$log" >/dev/null 2>&1
  else
    $MPI -np "$np" "$B" train --model "$MODEL" --steps "$STEPS" --threads 1 --layout "$layout" --log "$log" >/dev/null 2>&1
  fi
  python3 - "$log" "$layout" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
last = rows[-1]
c = last["comm_bytes"]
mib = lambda b: b / 2**20
print(f"{sys.argv[2]:>28}: step {last['seconds']:.2f} s, collectives outside the model {100*last['comm_seconds']/last['seconds']:.0f} %, "
      f"all-reduce {mib(c['allreduce']):.2f} MiB, all-gather {mib(c['allgather']):.2f} MiB, reduce-scatter {mib(c['reduce_scatter']):.2f} MiB per step (rank 0)")
PY
}
run tp=1 1
run tp=2 2
run fsdp=2 2
run fsdp=2,bucket_policy=lcm 2
run tp=2,fsdp=2 4
run fsdp=4 4
