#!/usr/bin/env bash
# Configures and builds tsd into build/ (or the directory given with -B).
#   scripts/build.sh                      plain build: build/bin/tsd, build/bin/tsctl
#   scripts/build.sh -B build-asan -DTSD_SANITIZE=address,undefined
set -euo pipefail
cd "$(dirname "$0")/.."
dir=build
if [ "${1:-}" = "-B" ]; then dir=$2; shift 2; fi
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
[ -f "$dir/CMakeCache.txt" ] || cmake -S . -B "$dir" "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
cmake -S . -B "$dir" "$@" >/dev/null
cmake --build "$dir" -j"$(nproc)"
