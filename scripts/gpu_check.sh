#!/usr/bin/env bash
# One command that proves the CUDA paths on a machine with one NVIDIA GPU, in at most 8 minutes,
# and prints a report (docs/GPU_CHECK.md). Build here (nvcc is enough, no GPU needed), carry the
# build, run there:
#
#   scripts/gpu_check.sh --prepare [BUILD_DIR]   # here: records what the device must run
#   scripts/gpu_check.sh [BUILD_DIR] [--only STEP,...] [--out DIR]   # on the GPU machine
#   scripts/gpu_check.sh --plan [BUILD_DIR]      # the steps and their expected device time
#   scripts/gpu_check.sh --cpu-reference [BUILD_DIR]   # the CPU halves of the comparisons only
#
# Without a GPU the check ends at once with exit 2 and one line. Exit 0: every step that ran
# passed; 1: a step failed (the report says which); 3: the build is not the prepared one.
set -uo pipefail
cd "$(dirname "$0")/.."

MODE=run
BUILD=build
ONLY=""
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --prepare) MODE=prepare ;;
    --plan) MODE=plan ;;
    --cpu-reference) MODE=cpu ;;
    --only) ONLY="$2"; shift ;;
    --out) OUT="$2"; shift ;;
    -h|--help) sed -n 2,13p "$0"; exit 0 ;;
    -*) echo "gpu_check: unknown option $1 (--help)" >&2; exit 64 ;;
    *) BUILD="$1" ;;
  esac
  shift
done
CLI="$BUILD/cli/reshard"
STAMP="$BUILD/gpu_check.stamp"

# The steps: name, expected device seconds (from the sizes, see docs/GPU_CHECK.md), what it does.
STEPS=(
  "build:5:the build is the prepared one (commit, binaries' hashes), the device is visible"
  "test_cuda:60:every test_cuda case (kernels against the CPU, f32 and bf16)"
  "families:40:3 training steps per family with a CUDA path, losses against the CPU's (1e-4 relative, f32)"
  "layouts2:90:2 ranks sharing the GPU (--device-comm host): dp, fsdp, ep, tp, etp, cp (ep-as-cp rules); losses against the CPU's at the same layout"
  "layouts4:60:4 ranks sharing the GPU: ep=2,tp=2 (EP over tp) and dp=2,tp=2; losses against the CPU's"
  "resume:30:save on the GPU at tp=1, resume on the CPU at tp=2 (2 processes): the step and the next losses"
  "labs:60:the kernel labs (build/lab/lab_*): checked against the CPU, then GB/s or TFLOP/s against the peak"
  "throughput:110:small-moe and moe-2b step time and MFU, bf16 fused / unfused and f32 (bench/train_gpu.sh)"
)

wanted() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }

if [ "$MODE" = plan ]; then
  total=0
  printf '%-11s %6s  %s\n' step "dev s" "what"
  for s in "${STEPS[@]}"; do
    IFS=: read -r name secs what <<<"$s"
    wanted "$name" || continue
    printf '%-11s %6s  %s\n' "$name" "$secs" "$what"
    total=$((total + secs))
  done
  echo "expected device time: ${total} s (the budget is 480 s)"
  exit 0
fi

hash_of() { sha256sum "$1" 2>/dev/null | cut -c1-16; }
stamp_lines() {
  echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  for f in "$CLI" "$BUILD/cli/libreshard_cuda.so" "$BUILD/tests/test_cuda" "$BUILD"/lab/lab_*; do
    [ -f "$f" ] && echo "$(basename "$f") $(hash_of "$f")"
  done
}

if [ "$MODE" = prepare ]; then
  for f in "$CLI" "$BUILD/cli/libreshard_cuda.so" "$BUILD/tests/test_cuda"; do
    if [ ! -f "$f" ]; then
      echo "gpu_check: $f is missing: build with nvcc first (scripts/setup.sh $BUILD)" >&2
      exit 1
    fi
  done
  stamp_lines >"$STAMP"
  echo "gpu_check: prepared $STAMP:"
  sed 's/^/  /' "$STAMP"
  exit 0
fi

if [ "$MODE" = run ]; then
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi lists none); nothing was run"
    exit 2
  fi
fi

OUT=${OUT:-$(mktemp -d /tmp/gpu-check-XXXXXX)}
mkdir -p "$OUT"
REPORT="$OUT/report.txt"

# ---- the report ----
declare -a ROWS=()
failed=0
row() {  # name status seconds detail
  ROWS+=("$(printf '%-11s %-5s %7s  %s' "$1" "$2" "$3" "$4")")
  [ "$2" = FAIL ] && failed=1
  printf '%-11s %-5s %7s  %s\n' "$1" "$2" "$3" "$4" >&2
}
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# The losses of a training log (JSON lines), one per line.
losses() { grep -o '"loss":[-0-9.eE+]*' "$1" | cut -d: -f2; }
# Largest relative difference of two loss lists; "n/a" when their lengths differ or are 0.
max_rel() {
  paste -d' ' <(losses "$1") <(losses "$2") | awk -v na="$(losses "$1" | wc -l)" -v nb="$(losses "$2" | wc -l)" '
    { d = $1 - $2; if (d < 0) d = -d; r = d / ($2 < 0 ? -$2 : $2); if (r > m) m = r }
    END { if (na != nb || na == 0) print "n/a"; else printf "%.2e", m }'
}
within() { [ "$1" != n/a ] && awk -v r="$1" 'BEGIN { exit !(r <= 1e-4) }'; }

# Trains `steps` on `device` with `np` processes; the log goes to $OUT/<tag>.jsonl.
train() {
  local tag="$1" device="$2" np="$3" steps="$4"
  shift 4
  local cmd=("$CLI" train --device "$device" --steps "$steps" --log "$OUT/$tag.jsonl" "$@")
  # A fresh run's sizes (a resumed run keeps its checkpoint's).
  [[ " $* " == *" --resume "* ]] || cmd+=(--batch-size 8 --seq-len 16)
  [ "$device" = cuda ] && cmd+=(--precision f32)
  [ "$device" = cuda ] && [ "$np" -gt 1 ] && cmd+=(--device-comm host)
  rm -f "$OUT/$tag.jsonl"
  if [ "$np" -gt 1 ]; then
    timeout 240 mpirun --oversubscribe --allow-run-as-root -np "$np" "${cmd[@]}" >"$OUT/$tag.out" 2>&1
  else
    timeout 240 "${cmd[@]}" >"$OUT/$tag.out" 2>&1
  fi
}

# A comparison of the GPU's losses with the CPU's (the CPU run only in --cpu-reference mode).
compare() {
  local step="$1" tag="$2" np="$3"
  shift 3
  local t0
  t0=$(now)
  if ! train "$tag-cpu" cpu "$np" 3 "$@"; then
    row "$step" FAIL "$(since "$t0")" "$tag: the CPU run failed: $(tail -1 "$OUT/$tag-cpu.out")"
    return
  fi
  if [ "$MODE" = cpu ]; then
    row "$step" PASS "$(since "$t0")" "$tag: CPU losses $(losses "$OUT/$tag-cpu.jsonl" | tr '\n' ' ')"
    return
  fi
  if ! RESHARD_ALLOW_UNPROVEN=1 train "$tag-gpu" cuda "$np" 3 "$@"; then
    row "$step" FAIL "$(since "$t0")" "$tag: the GPU run failed: $(tail -1 "$OUT/$tag-gpu.out")"
    return
  fi
  local r
  r=$(max_rel "$OUT/$tag-gpu.jsonl" "$OUT/$tag-cpu.jsonl")
  if within "$r"; then
    row "$step" PASS "$(since "$t0")" "$tag: losses within $r of the CPU's"
  else
    row "$step" FAIL "$(since "$t0")" "$tag: losses differ by $r (GPU $(losses "$OUT/$tag-gpu.jsonl" | tr '\n' ' '))"
  fi
}

echo "gpu_check: $MODE, build $BUILD, report $REPORT" >&2
if [ "$MODE" = run ] && wanted build; then
  t0=$(now)
  if [ ! -f "$STAMP" ]; then
    row build FAIL "$(since "$t0")" "no $STAMP: run scripts/gpu_check.sh --prepare where it was built"
    printf '%s\n' "${ROWS[@]}" >"$REPORT"
    exit 3
  fi
  if ! diff -q <(stamp_lines | tail -n +2) <(tail -n +2 "$STAMP") >/dev/null; then
    row build FAIL "$(since "$t0")" "the binaries are not the prepared ones: $(diff <(stamp_lines) "$STAMP" | tr '\n' ' ')"
    printf '%s\n' "${ROWS[@]}" >"$REPORT"
    exit 3
  fi
  row build PASS "$(since "$t0")" "$(head -1 "$STAMP"), $(nvidia-smi -L | head -1)"
fi
if [ "$MODE" = run ] && wanted test_cuda; then
  t0=$(now)
  if timeout 180 "$BUILD/tests/test_cuda" >"$OUT/test_cuda.out" 2>&1; then
    row test_cuda PASS "$(since "$t0")" "$(grep -E '^\[  PASSED' "$OUT/test_cuda.out" | head -1)"
  else
    row test_cuda FAIL "$(since "$t0")" "$(grep -E 'FAILED' "$OUT/test_cuda.out" | head -3 | tr '\n' ' ')"
  fi
fi
if wanted families; then
  # Each family with a CUDA path, at toy size (byte vocabulary: the corpus is text).
  for family in mixtral qwen3_moe; do
    extra=""
    [ "$family" = qwen3_moe ] && extra=', "qk_norm": true'
    cat >"$OUT/$family.json" <<JSON
{"name": "check-$family", "family": "$family", "vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 4,
 "n_kv_heads": 2, "head_dim": 8, "n_experts": 4, "top_k": 2, "moe_ffn": 16, "dense_ffn": 32, "max_seq_len": 16$extra}
JSON
  done
  compare families moe 1 --model tiny-moe
  compare families mixtral 1 --model "$OUT/mixtral.json"
  compare families qwen3_moe 1 --model "$OUT/qwen3_moe.json"
  row families SKIP 0 "deepseek_v3, qwen3_next: no CUDA path (reshard models)"
fi
if wanted layouts2; then
  for layout in dp=2 fsdp=2 ep=2 tp=2 etp=2; do
    compare layouts2 "l2-${layout//[=,]/_}" 2 --model tiny-moe --layout "$layout"
  done
  # Context parallelism trains as the ep axis under the ep-as-cp rules.
  compare layouts2 l2-cp_2 2 --model tiny-moe --layout ep=2 --rules ep-as-cp
fi
if wanted layouts4; then
  for layout in ep=2,tp=2 dp=2,tp=2; do
    compare layouts4 "l4-${layout//[=,]/_}" 4 --model tiny-moe --layout "$layout"
  done
fi
if wanted resume; then
  t0=$(now)
  rm -rf "$OUT/ck"
  device=cuda
  [ "$MODE" = cpu ] && device=cpu
  if train resume-save "$device" 1 2 --model tiny-moe --save "$OUT/ck" &&
    train resume-cpu cpu 2 4 --resume "$OUT/ck" --layout tp=2; then
    row resume PASS "$(since "$t0")" "saved on $device at step 2, resumed on the CPU at tp=2: steps 3-4 losses $(losses "$OUT/resume-cpu.jsonl" | tr '\n' ' ')"
  else
    row resume FAIL "$(since "$t0")" "$(tail -1 "$OUT/resume-save.out") $(tail -1 "$OUT/resume-cpu.out" 2>/dev/null)"
  fi
fi
if [ "$MODE" = run ] && wanted labs; then
  for lab in "$BUILD"/lab/lab_*; do
    [ -x "$lab" ] || continue
    t0=$(now)
    name=$(basename "$lab")
    if timeout 60 "$lab" >"$OUT/$name.out" 2>&1; then
      row labs PASS "$(since "$t0")" "$name: $(grep -Eo '[0-9.]+ (GB/s|TFLOP/s)[^|]*' "$OUT/$name.out" | head -2 | tr '\n' ';')"
    else
      row labs FAIL "$(since "$t0")" "$name: $(tail -2 "$OUT/$name.out" | tr '\n' ' ')"
    fi
  done
fi
if [ "$MODE" = run ] && wanted throughput; then
  t0=$(now)
  if timeout 200 bash bench/train_gpu.sh "$BUILD" 10 all >"$OUT/throughput.out" 2>&1; then
    row throughput PASS "$(since "$t0")" "$(grep -c '^steps' "$OUT/throughput.out") runs; lines in $OUT/throughput.out"
  else
    row throughput FAIL "$(since "$t0")" "$(tail -2 "$OUT/throughput.out" | tr '\n' ' ')"
  fi
fi

{
  echo "gpu_check ($MODE) $(date -u +%FT%TZ), build $BUILD"
  printf '%-11s %-5s %7s  %s\n' step stat seconds detail
  printf '%s\n' "${ROWS[@]}"
  [ "$MODE" = run ] && grep -E '^(==|cuda|steps|model)' "$OUT/throughput.out" 2>/dev/null
} >"$REPORT"
cat "$REPORT"
exit "$failed"
