#!/usr/bin/env bash
# Prints the FSDP bucket table of docs/FSDP_BUCKETS.md: padding of every policy under both shard granularities
# and the largest bucket, one bucket per FSDP unit, for the three presets at ep 1 and 8 and
# dp 8, 64, 256. Usage: scripts/bucket_table.sh [path/to/reshard] [extra buckets flags...]
set -euo pipefail
B=${1:-build/cli/reshard}
shift || true
echo "| model | ep | dp | matrix: lcm | split | best | largest | element: lcm | split | best | largest |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
for m in deepseek-v3 qwen3-30b-a3b mixtral-8x7b; do
  for ep in 1 8; do
    for dp in 8 64 256; do
      "$B" buckets --model "$m" --ep "$ep" --dp "$dp" --compare --json "$@" | python3 -c '
import json, sys
j = json.load(sys.stdin)
def cell(g, p):
    for r in j["policies"]:
        if r["granularity"] == g and r["policy"] == p:
            return r
def pct(r):
    f = 100 * r["padding_fraction"]
    return "0 %" if f == 0 else ("%.2f %%" % f if f >= 1 else "%.4f %%" % f if f >= 1e-4 else "< 0.0001 %")
def gib(r): return "%.2f GiB" % (r["largest_bucket_bytes"] / 2**30)
row = [j["model"], str(j["ep"]), str(j["dp"])]
for g in ("matrix", "element"):
    row += [pct(cell(g, p)) for p in ("lcm", "split", "best")] + [gib(cell(g, "best"))]
print("| " + " | ".join(row) + " |")
'
    done
  done
done
