#!/usr/bin/env bash
# Installs what is missing from Debian packages, then configures and builds (Release,
# warnings on). Safe to run again: packages already present are not touched, and the build is
# incremental. Usage: scripts/setup.sh [BUILD_DIR]   (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build}

PACKAGES=(build-essential cmake pkg-config libhdf5-dev zlib1g-dev libzstd-dev libxxhash-dev libcli11-dev
          nlohmann-json3-dev libgtest-dev openmpi-bin libopenmpi-dev libopenblas-dev)
# The fuzzers (fuzz/run.sh): clang, its sanitizer and libFuzzer runtimes (libclang_rt.fuzzer,
# .asan, .ubsan: libclang-rt-14-dev) and llvm-symbolizer (llvm-14) for readable stacks.
PACKAGES+=(clang-14 libclang-rt-14-dev llvm-14)
# The format check of CI (scripts/format.sh --check).
PACKAGES+=(clang-format-14)
# Peak memory of the commands bench_many_files measures (GNU time).
PACKAGES+=(time)
# A compiler cache: a rebuild after a change, a second build directory or the fuzz build's
# unchanged sources compile once (the scripts pass it to CMake as the compiler launcher).
PACKAGES+=(ccache)
# The picture tests render every SVG the tool writes with a real renderer (rsvg-convert).
PACKAGES+=(librsvg2-bin)
t0=$SECONDS
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# nvcc is optional: with it, CUDA targets are built (sm_90 + PTX); without it they are skipped.
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi

echo "setup: packages $(( SECONDS - t0 )) s" >&2

JOBS=${JOBS:-$(nproc)}
LAUNCHER=()
if command -v ccache >/dev/null 2>&1; then
  LAUNCHER=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
t0=$SECONDS
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release "${LAUNCHER[@]}" >/dev/null
echo "setup: configure $(( SECONDS - t0 )) s" >&2
t0=$SECONDS
cmake --build "$BUILD_DIR" -j "$JOBS"
echo "setup: build $(( SECONDS - t0 )) s" >&2
