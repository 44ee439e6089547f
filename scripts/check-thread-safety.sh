#!/usr/bin/env bash
# Compiles tsd and its C++ client with clang and its thread-safety analysis as errors
# (-Wthread-safety -Werror=thread-safety) into build-clang/, so every ABSL_GUARDED_BY /
# ABSL_EXCLUSIVE_LOCKS_REQUIRED annotation on a tsd::Mutex (proto/mutex.h) is checked: touching a
# guarded field without its lock, or calling a method that needs a lock without holding it, fails
# the build. GCC ignores these annotations, so this is the only build that checks them.
#   scripts/check-thread-safety.sh           configure and compile build-clang/
# Needs clang (scripts/setup.sh installs Debian's clang-14). The analysis runs in the compiler's
# front end, so this compiles every object of the daemon, the client, the protocol and the examples
# and links nothing. Left out: tests and benchmarks, and kernels/ (no locks there, and clang-14
# does not know the "f16c" name that kernels/cpu/dispatch.cc gives __builtin_cpu_supports).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=build-clang
cxx=$(command -v clang++ || command -v clang++-14 || true)
cc=$(command -v clang || command -v clang-14 || true)
if [ -z "$cxx" ] || [ -z "$cc" ]; then
  echo "check-thread-safety: clang++ not found; install it with scripts/setup.sh (Debian: clang)" >&2
  exit 1
fi
# Debug: no optimisation, the analysis runs in the front end and needs none.
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Debug \
  -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" \
  -DCMAKE_CXX_FLAGS="-Wthread-safety -Werror=thread-safety" \
  -DTSD_WITH_CUDA=OFF -DTSD_BUILD_BENCH=OFF -DTSD_BUILD_TESTS=OFF >/dev/null
mapfile -t objects < <(ninja -C "$dir" -t targets all | sed -n 's/^\(.*\.o\): .*/\1/p' |
                        grep -v '^kernels/')
# -k 0: report every file the analysis rejects, not only the first.
ninja -C "$dir" -k 0 -j"$(nproc)" "${objects[@]}"
echo "check-thread-safety: the thread-safety analysis found nothing ($dir)"
