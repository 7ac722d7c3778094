#!/usr/bin/env bash
# Benchmark: communication bytes and step time of multi-rank training (not run by CTest).
#
# For each layout it trains MODEL (default small-moe) for STEPS steps under mpirun and prints,
# from rank 0's log of the last step, the bytes rank 0 received per step by kind next to the
# analytic volume:
#  - all-gather and reduce-scatter: `reshard buckets --model MODEL --tp T --dp F --policy P`
#    (the FSDP bucket plan of the TP-local f32 master weights; each is received once per step);
#  - all-reduce: the tensor-parallel activations of train/MODEL.md §11 – per step, with n local
#    tokens, d = d_model, L layers, k = top_k: f32 n·d·(2 + 4L) + n + L_moe·n·k and f64 2n,
#    times 2(p−1)/p – plus the data-parallel gradient all-reduce 2(dp−1)/dp · 4·(owned items);
#    plus, with ep, the non-expert gradient all-reduce over ep; the remainder ("other") is the loss and router statistics and the global norm (scalars);
#  - all-to-all (ep): four exchanges per MoE layer (rows, outputs, output gradients, input
#    gradients), each receiving (ep−1)/ep · n·k·d·4 bytes when routing is balanced; the ratio
#    measured / balanced is the routing imbalance of the step.
# and the step time with the share spent inside collectives (waiting for peers included).
# Usage: bench/train_comm.sh [BUILD_DIR] [MODEL] [STEPS] [BATCH]
set -euo pipefail
B=${1:-build}/cli/reshard
MODEL=${2:-small-moe}
STEPS=${3:-2}
BATCH=${4:-8}
MPI="mpirun --oversubscribe --allow-run-as-root"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

axis() {  # layout axis -> size (1 when absent)
  local v
  v=$(tr ',' '\n' <<<"$1" | sed -n "s/^$2=\([0-9]*\)$/\1/p")
  echo "${v:-1}"
}

run() {  # layout
  local layout=$1 log="$tmp/log.jsonl" tp fsdp dp ep np policy gran form
  tp=$(axis "$layout" tp); fsdp=$(axis "$layout" fsdp); dp=$(axis "$layout" dp); ep=$(axis "$layout" ep)
  np=$((tp * fsdp * dp * ep))
  policy=$(tr ',' '\n' <<<"$layout" | sed -n 's/^bucket_policy=//p'); policy=${policy:-best}
  gran=$(tr ',' '\n' <<<"$layout" | sed -n 's/^bucket_granularity=//p'); gran=${gran:-element}
  form=$(tr ',' '\n' <<<"$layout" | sed -n 's/^fsdp_form=//p'); form=${form:-flat}
  rm -f "$log"
  local args=(train --model "$MODEL" --steps "$STEPS" --batch-size "$BATCH" --threads 1 --log "$log")
  [ -n "$layout" ] && args+=(--layout "$layout")
  if [ "$np" = 1 ]; then "$B" "${args[@]}" >/dev/null 2>&1; else $MPI -np "$np" "$B" "${args[@]}" >/dev/null 2>&1; fi
  "$B" buckets --model "$MODEL" --tp "$tp" --dp "$fsdp" --policy "$policy" --granularity "$gran" \
    --json --summary >"$tmp/plan.json"
  python3 - "$log" "$tmp/plan.json" "${layout:-tp=1}" "$tp" "$fsdp" "$dp" "$BATCH" "$form" "$ep" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
plan = json.load(open(sys.argv[2]))
layout, tp, fsdp, dp, batch = sys.argv[3], *map(int, sys.argv[4:8])
m = plan["train_model"]
last = rows[-1]
c = last["comm_bytes"]
mib = lambda b: b / 2**20
seq = last["tokens"] // batch
ep = int(sys.argv[9])
n = batch * seq // (dp * fsdp * ep)
d, L, k = m["d_model"], m["n_layers"], m["top_k"]
l_moe = L - m["first_dense_layers"]
ar = lambda nbytes, p: 2 * (p - 1) / p * nbytes
tp_act = ar(4 * (n * d * (2 + 4 * L) + n + l_moe * n * k) + 8 * 2 * n, tp)
owned = plan["total_bytes"] / fsdp  # f32 items of a rank's shard (bucket shards incl. padding)
dp_grad = ar(owned, dp)
a2a = 4 * l_moe * (ep - 1) / ep * n * k * d * 4
# ep: the non-expert gradients are summed over ep (the experts' are complete on their rank).
expert_bytes = l_moe * m["n_experts"] * 3 * m["moe_ffn"] * d * 4 / tp
ep_grad = ar(plan["total_bytes"] - expert_bytes, ep)
# Flat: the bucket plan. Box: each rank's boxes, (fsdp - 1) / fsdp of the parameters when the
# cuts are even (the all-gather pads every rank's vector to the largest).
box = sys.argv[8] == "box"
ag = 0 if fsdp == 1 else plan["param_bytes"] * (fsdp - 1) / fsdp if box else plan["allgather_bytes_per_rank"]
print(f"{layout:>26}: step {last['seconds']:6.2f} s ({100*last['collective_seconds']/last['seconds']:3.0f} % in collectives) | "
      f"all-gather {mib(c['allgather']):7.2f} MiB (plan {mib(ag):7.2f}) | reduce-scatter {mib(c['reduce_scatter']):7.2f} MiB "
      f"(plan {mib(ag):7.2f}) | all-reduce {mib(c['allreduce']):7.2f} MiB (tp activations {mib(tp_act):.2f} + dp grads "
      f"{mib(dp_grad):.2f} + ep grads {mib(ep_grad):.2f}, other {c['allreduce'] - tp_act - dp_grad - ep_grad:+.0f} B)"
      + (f" | all-to-all {mib(c['alltoall']):.2f} MiB (balanced {mib(a2a):.2f}, x{c['alltoall'] / a2a:.3f})" if ep > 1 else ""))
PY
}
echo "model $MODEL, batch $BATCH, rank 0's bytes received per step (last of $STEPS steps)"
run ""
run tp=2
run fsdp=2
run fsdp=4
run fsdp=4,bucket_policy=lcm
run fsdp=4,bucket_granularity=matrix
run fsdp=4,bucket_granularity=matrix,bucket_policy=lcm
run tp=2,fsdp=2
run fsdp=2,fsdp_form=box
run dp=2
run ep=2
run ep=4

# Fused vs unfused dispatch at ep=2: step time and peak RSS per rank (the exchange buffers).
for mode in fused unfused; do
  rm -f "$tmp/log.jsonl"
  # shellcheck disable=SC2016  # $OMPI_COMM_WORLD_RANK expands in each rank's shell
  $MPI -np 2 bash -c '/usr/bin/time -f "%M" -o "$0/rss.$OMPI_COMM_WORLD_RANK" "$@"' "$tmp" "$B" train --model "$MODEL" \
    --steps "$STEPS" --batch-size "$BATCH" --threads 1 --layout ep=2 --align 128 --dispatch "$mode" \
    --log "$tmp/log.jsonl" >/dev/null 2>&1
  python3 - "$tmp/log.jsonl" "$mode" "$tmp"/rss.* <<'PY'
import json, sys
last = [json.loads(l) for l in open(sys.argv[1])][-1]
rss = [int(open(f).read().split()[-1]) / 1024 for f in sys.argv[3:]]
print(f"ep=2 --align 128 --dispatch {sys.argv[2]:>7}: step {last['seconds']:.2f} s, peak RSS per rank " + ", ".join(f"{r:.0f} MiB" for r in rss))
PY
  rm -f "$tmp"/rss.*
done
