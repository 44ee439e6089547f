#!/usr/bin/env bash
# Configures and builds tsd into build/ (or the directory given with -B).
#   scripts/build.sh                      plain build: build/bin/tsd, build/bin/tsctl
#   scripts/build.sh -B build-asan -DTSD_SANITIZE=address,undefined
set -euo pipefail
cd "$(dirname "$0")/.."
dir=build
if [ "${1:-}" = "-B" ]; then dir=$2; shift 2; fi
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
# libtorch, from the venv's torch where there is one: examples/cpp/torch_trainer is built (and
# its check runs in ctest) only where CMake finds it.
if [ -x .venv/bin/python ] && tdir=$(.venv/bin/python -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null); then
  set -- -DTorch_DIR="$tdir/Torch" "$@"
fi
[ -f "$dir/CMakeCache.txt" ] || cmake -S . -B "$dir" "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
cmake -S . -B "$dir" "$@" >/dev/null
cmake --build "$dir" -j"$(nproc)"
