#!/usr/bin/env bash
# Runs every test: builds (scripts/build.sh) and runs the C++ suites with ctest, then the Python
# suites with pytest from .venv/. Run scripts/setup.sh once first.
#   scripts/test.sh                                   the plain build in build/
#   scripts/test.sh --sanitize address,undefined      the C++ suites in an ASan+UBSan build
#   scripts/test.sh --sanitize thread                 ... in a TSan build
set -euo pipefail
cd "$(dirname "$0")/.."
san=""
if [ "${1:-}" = "--sanitize" ]; then san=$2; fi

if [ -n "$san" ]; then
  dir="build-${san//,/-}"
  scripts/build.sh -B "$dir" -DTSD_SANITIZE="$san" -DTSD_WITH_CUDA=OFF -DTSD_BUILD_BENCH=OFF
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
  export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tests/tsan.supp"
  skip=()
  # The kernel suites are single-threaded arithmetic (10x slower under TSan, nothing to find).
  [ "$san" = thread ] && skip=(-E 'AdamWIsaTest|AdamWKernel')
  (cd "$dir" && ctest --output-on-failure -j2 --timeout 300 "${skip[@]}")
  exit 0
fi

scripts/build.sh
(cd build && ctest --output-on-failure -j2 --timeout 300)
if ls tests/python/test_*.py >/dev/null 2>&1; then
  .venv/bin/python -m pytest -q tests/python
fi
# The trainstream package is typed: its annotations must check (the extension has no stubs).
.venv/bin/python -m mypy --ignore-missing-imports --follow-imports=silent client-py/trainstream
