#!/usr/bin/env bash
# Builds everything and runs the whole test suite with CTest (GPU tests skip without a device).
set -euo pipefail
cd "$(dirname "$0")/.."
# Optional independent readers used by interoperability tests (skipped when unavailable),
# installed in the background while the build runs (downloads, not compiling). TensorBoard
# reads the event files of `train --tensorboard` (its own dependencies are larger: installed
# apart, so that a failure there does not take the readers with it).
t0=$SECONDS
(
  python3 -m pip install -q h5py hdf5plugin numpy safetensors >/dev/null 2>&1 ||
    echo "test: python readers unavailable; interop tests will skip" >&2
  python3 -m pip install -q tensorboard >/dev/null 2>&1 ||
    echo "test: tensorboard unavailable; its interop tests will skip" >&2
  echo "test: python packages $(( SECONDS - t0 )) s (beside the build)" >&2
) &
pip_pid=$!
scripts/setup.sh build
echo "test: set-up and build $(( SECONDS - t0 )) s" >&2
wait "$pip_pid" || true
cd build
t0=$SECONDS
rc=0
ctest --output-on-failure -j "$(nproc)" --timeout 600 "$@" || rc=$?
echo "test: ctest $(( SECONDS - t0 )) s" >&2
exit "$rc"
