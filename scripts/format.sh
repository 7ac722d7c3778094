#!/usr/bin/env bash
# Formats every C++ and CUDA source of the repository with clang-format 14 and .clang-format.
# Usage: scripts/format.sh          rewrite the files in place
#        scripts/format.sh --check  change nothing; list the files that differ and exit 1 if any
# (CI runs --check: .ci/run). clang-format-14 comes from scripts/setup.sh; the version is pinned
# because the output of clang-format changes between major versions.
set -euo pipefail
cd "$(dirname "$0")/.."
FORMAT=$(command -v clang-format-14 || true)
if [ -z "$FORMAT" ]; then
  echo "format: clang-format-14 is not installed (scripts/setup.sh installs it)" >&2
  exit 2
fi
mapfile -t FILES < <(git ls-files '*.cc' '*.h' '*.cu' '*.cuh')
if [ "${1:-}" = "--check" ]; then
  bad=()
  for f in "${FILES[@]}"; do
    if ! "$FORMAT" --style=file "$f" | cmp -s - "$f"; then bad+=("$f"); fi
  done
  if [ ${#bad[@]} -gt 0 ]; then
    echo "format: ${#bad[@]} file(s) differ from clang-format-14 (run scripts/format.sh):" >&2
    printf '  %s\n' "${bad[@]}" >&2
    exit 1
  fi
  echo "format: ${#FILES[@]} files clean"
else
  "$FORMAT" --style=file -i "${FILES[@]}"
fi
