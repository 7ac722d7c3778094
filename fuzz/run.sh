#!/usr/bin/env bash
# Builds the libFuzzer targets of fuzz/ with clang (AddressSanitizer + UndefinedBehaviorSanitizer)
# in build-fuzz/, then runs each for SECONDS (default 60) on its seed corpus, FUZZ_JOBS at a time
# (default: one per core).
# Exits 1 if any target crashed, failed a check, threw, leaked, hung (-timeout) or allocated too
# much (-rss_limit_mb / -malloc_limit_mb), after printing the reproducer's path and the command
# that replays it. New inputs go to build-fuzz/fuzz-out/<target>/corpus, never into the repo.
#
# Usage: fuzz/run.sh [SECONDS] [TARGET...]      (targets: fuzz_manifest fuzz_checkpoint
#        fuzz_shard_file fuzz_shard_file_inplace fuzz_layout fuzz_model fuzz_events fuzz_safetensors
#        fuzz_dcp_metadata fuzz_dcp_data fuzz_torch_save; default all)
# Environment: BUILD_DIR (build-fuzz), JOBS (2, compile jobs), FUZZ_JOBS (nproc, targets run at
# once), FUZZ_ARGS (extra libFuzzer flags).
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${1:-60}
[ $# -gt 0 ] && shift
BUILD=${BUILD_DIR:-build-fuzz}
JOBS=${JOBS:-2}
ALL=(fuzz_manifest fuzz_checkpoint fuzz_shard_file fuzz_shard_file_inplace fuzz_layout fuzz_model fuzz_events
     fuzz_safetensors fuzz_dcp_metadata fuzz_dcp_data fuzz_torch_save)
TARGETS=("$@")
[ ${#TARGETS[@]} -eq 0 ] && TARGETS=("${ALL[@]}")

CC=$(command -v clang-14 || command -v clang || true)
CXX=$(command -v clang++-14 || command -v clang++ || true)
if [ -z "$CC" ] || [ -z "$CXX" ]; then
  echo "fuzz: clang is not installed (scripts/setup.sh installs clang-14 and libclang-rt-14-dev)" >&2
  exit 2
fi
if ! ls "$("$CXX" --print-runtime-dir 2>/dev/null)"/libclang_rt.fuzzer*.a >/dev/null 2>&1; then
  echo "fuzz: $CXX has no libFuzzer runtime (libclang_rt.fuzzer; Debian: libclang-rt-14-dev, which" \
       "scripts/setup.sh installs)" >&2
  exit 2
fi
LAUNCHER=()
command -v ccache >/dev/null 2>&1 && LAUNCHER=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)

start=$(date +%s)
# Line tables are all a sanitizer report needs (file:line of each frame); full debug info
# made the build slower and its objects several times larger.
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER="$CC" -DCMAKE_CXX_COMPILER="$CXX" \
  -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O2 -gline-tables-only -DNDEBUG" -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -gline-tables-only -DNDEBUG" \
  "${LAUNCHER[@]}" -DRS_FUZZ=ON -DRS_BUILD_TESTS=OFF -DRS_ENABLE_CUDA=OFF >/dev/null
cmake --build "$BUILD" -j "$JOBS" --target fuzzers
echo "fuzz: built in $(( $(date +%s) - start )) s" >&2

# llvm-symbolizer turns sanitizer stacks into file:line.
for s in llvm-symbolizer-14 llvm-symbolizer; do
  if command -v "$s" >/dev/null 2>&1; then export ASAN_SYMBOLIZER_PATH=$(command -v "$s"); break; fi
done
export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:allocator_may_return_null=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
# Leaks inside HDF5 on corrupt files are the library's (see the file).
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$PWD/fuzz/lsan.supp:print_suppressions=0}

corpus_of() {
  case "$1" in
    fuzz_shard_file|fuzz_shard_file_inplace) echo shard_file ;;
    *) echo "${1#fuzz_}" ;;
  esac
}
dict_of() {
  case "$1" in
    fuzz_manifest|fuzz_checkpoint) echo manifest ;;
    fuzz_layout) echo layout ;;
    fuzz_model) echo model ;;
    *) echo "" ;;
  esac
}

# One target for SECONDS_EACH: its summary line goes to $out/summary, FAILED in it when it failed.
fuzz_one() {
  local t=$1
  local bin="$BUILD/fuzz/$t"
  local out="$BUILD/fuzz-out/$t"
  rm -rf "$out/artifacts" "$out"/log*  # reproducers and logs of an earlier run
  mkdir -p "$out/corpus" "$out/artifacts"
  seeds="fuzz/corpus/$(corpus_of "$t")"
  args=(-timeout=10 -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$out/artifacts/")
  asan=$ASAN_OPTIONS
  case "$t" in
    fuzz_shard_file*)
      # HDF5 1.10 mallocs sizes read from corrupt metadata before it checks them against the
      # file (H5C_protect), then fails the read and frees the buffer untouched: with a malloc
      # limit the fuzzer would stop at the first such size. So here the malloc limit is off,
      # impossible C mallocs return NULL as in production (HDF5 reports an error), C++
      # allocations still abort, and -rss_limit_mb bounds the memory actually used. The
      # harness bounds what our reader allocates (datasets of at most 16 MiB).
      args+=(-max_len=16384 -malloc_limit_mb=1048576)
      asan="$asan:allocator_may_return_null=1" ;;
    *) args+=(-max_len=65536 -malloc_limit_mb=1024) ;;
  esac
  d=$(dict_of "$t")
  if [ -n "$d" ]; then
    cat fuzz/dict/json.dict "fuzz/dict/$d.dict" > "$out/dict"
    args+=(-dict="$out/dict")
  fi
  # shellcheck disable=SC2086
  args+=(${FUZZ_ARGS:-})
  echo "fuzz: $t for ${SECONDS_EACH} s (seeds $seeds)" >&2
  t0=$(date +%s)
  deadline=$(( t0 + SECONDS_EACH ))
  execs=0 runs=0 rc=0 cov="?" status=""
  # libFuzzer stops at the first failure: any crash, sanitizer report, timeout or runaway
  # allocation fails the run. (HDF5's own crashes on damaged files happen in child processes,
  # where the reader reports them as DataLoss: fuzz/hdf5/README.md.)
  while :; do
    left=$(( deadline - $(date +%s) ))
    [ "$runs" -gt 0 ] && [ "$left" -le 0 ] && break
    log="$out/log.$runs"
    rc=0
    # In a subshell whose stderr is dropped: bash's own "Aborted" line for a crashed target.
    (ASAN_OPTIONS=$asan "$bin" "${args[@]}" -max_total_time=$(( left > 1 ? left : 1 )) "$out/corpus" "$seeds" \
      >"$log" 2>&1; exit $?) 2>/dev/null || rc=$?
    runs=$(( runs + 1 ))
    n=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    execs=$(( execs + ${n:-0} ))
    c=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
    [ -n "$c" ] && cov=$c
    artifacts=$(find "$out/artifacts" -type f | sort)
    [ "$rc" -eq 0 ] && [ -z "$artifacts" ] && break
    status="FAILED (exit $rc)"
    echo "fuzz: $t FAILED (exit $rc); log: $log" >&2
    grep -E '^(==[0-9]+==.*ERROR|SUMMARY|CHECK failed|.*runtime error)' "$log" | head -5 >&2 || true
    for a in $artifacts; do
      echo "fuzz: reproducer: $a" >&2
      echo "fuzz:   replay:   $bin $a" >&2
    done
    break
  done
  secs=$(( $(date +%s) - t0 ))
  line="$t: ${secs} s, $execs execs ($(( execs / (secs > 0 ? secs : 1) ))/s), coverage $cov edges"
  [ "$runs" -gt 1 ] && line="$line, $runs runs"
  [ -n "$status" ] && line="$line: $status"
  echo "$line" > "$out/summary"
}

# The targets run FUZZ_JOBS at a time (default: one per core; libFuzzer runs one thread), each
# for SECONDS_EACH, so the fuzzing per target is the same whatever the parallelism.
for t in "${TARGETS[@]}"; do
  [ -x "$BUILD/fuzz/$t" ] || { echo "fuzz: no target $t" >&2; exit 2; }
  rm -f "$BUILD/fuzz-out/$t/summary"
done
PAR=${FUZZ_JOBS:-$(nproc)}
running=0
for t in "${TARGETS[@]}"; do
  fuzz_one "$t" &
  running=$(( running + 1 ))
  if [ "$running" -ge "$PAR" ]; then
    wait -n || true
    running=$(( running - 1 ))
  fi
done
wait
failed=0
summary=()
for t in "${TARGETS[@]}"; do
  f="$BUILD/fuzz-out/$t/summary"
  if [ -f "$f" ]; then
    line=$(cat "$f")
  else
    line="$t: no result (the run ended abnormally): FAILED"
  fi
  case "$line" in *FAILED*) failed=1 ;; esac
  summary+=("$line")
done
echo "fuzz: summary ($(( $(date +%s) - start )) s in all, build included)" >&2
printf '  %s\n' "${summary[@]}" >&2
exit "$failed"
