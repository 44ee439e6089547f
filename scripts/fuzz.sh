#!/usr/bin/env bash
# Builds tsd's libFuzzer targets (tests/fuzz/) with clang, ASan and UBSan into build-fuzz/ and runs
# them. FUZZ_JOBS sets the build's parallelism (default: every CPU). Each target keeps its corpus in tests/fuzz/corpus/<target>/: the seed-* files are in the
# repository, and what a run finds is added beside them (git-ignored), so the next run goes on
# from there. Crashes, leaks and timeouts are written to build-fuzz/artifacts/ and fail the run.
#   scripts/fuzz.sh TARGET SECONDS    run one target (e.g. fuzz_side_handler 600)
#   scripts/fuzz.sh TARGET SECONDS RUNS  ... and stop after RUNS executions if that comes first
#   scripts/fuzz.sh --smoke [SECONDS] run every target for SECONDS each (default 30): CI's smoke
#   scripts/fuzz.sh --list            the targets
#   scripts/fuzz.sh --seed            rewrite the seed-* inputs (after a protocol change)
# Prints one line per run: executions, executions per second, coverage (edges), features, corpus.
# Needs clang-14 with compiler-rt's libFuzzer (Debian: clang, libclang-rt-14-dev; setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
targets=(fuzz_side_message fuzz_side_handler fuzz_grpc_service fuzz_config fuzz_state_file fuzz_safetensors
  fuzz_control_page)
dir=build-fuzz
cxx=$(command -v clang++-14 || command -v clang++ || true)
cc=$(command -v clang-14 || command -v clang || true)

build() {
  if [ -z "$cxx" ] || [ -z "$cc" ]; then
    echo "fuzz: clang not found; install it with scripts/setup.sh (Debian: clang)" >&2
    exit 1
  fi
  if [ ! -f "$dir/build.ninja" ]; then
    cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" -DTSD_FUZZ=ON \
      -DTSD_SANITIZE=address,undefined -DTSD_WITH_CUDA=OFF -DTSD_BUILD_TESTS=OFF \
      -DTSD_BUILD_BENCH=OFF >/dev/null
  fi
  local log
  log=$(mktemp)
  if ! ninja -C "$dir" -j"${FUZZ_JOBS:-$(nproc)}" "$@" >"$log" 2>&1; then
    grep -E 'error|FAILED' -A5 "$log" | head -60 >&2
    rm -f "$log"
    echo "fuzz: building $* in $dir failed" >&2
    exit 1
  fi
  rm -f "$log"
}

# run TARGET SECONDS [RUNS]: prints "fuzz: TARGET: ..." and fails on any finding.
run() {
  local target=$1 seconds=$2 corpus="tests/fuzz/corpus/$1" log runs=()
  [ -n "${3:-}" ] && runs=(-runs="$3")
  mkdir -p "$corpus" "$dir/artifacts"
  log=$(mktemp)
  local rc=0 start=$SECONDS
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    "$dir/bin/$target" "$corpus" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -max_len=8192 -print_final_stats=1 -artifact_prefix="$dir/artifacts/$target-" "${runs[@]}" \
    >"$log" 2>&1 || rc=$?
  local execs rate cov ft units
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
  ft=$(grep -o 'ft: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
  units=$(find "$corpus" -type f | wc -l)
  echo "fuzz: $target: ${execs:-?} executions in $((SECONDS - start)) s (${rate:-?}/s), cov ${cov:-?} edges," \
       "ft ${ft:-?}, corpus $units inputs"
  if [ "$rc" -ne 0 ]; then
    echo "fuzz: $target FAILED (exit $rc); the end of its log:" >&2
    tail -40 "$log" >&2
    rm -f "$log"
    return 1
  fi
  rm -f "$log"
}

case "${1:-}" in
  --list)
    printf '%s\n' "${targets[@]}"
    ;;
  --seed)
    build fuzz_make_seeds
    "$dir/bin/fuzz_make_seeds" tests/fuzz/corpus
    echo "fuzz: seeds written under tests/fuzz/corpus/"
    ;;
  --smoke)
    seconds=${2:-30}
    build "${targets[@]}"
    failed=0
    for t in "${targets[@]}"; do run "$t" "$seconds" || failed=1; done
    exit $failed
    ;;
  "" | -h | --help)
    sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
    ;;
  *)
    target=$1
    seconds=${2:?usage: scripts/fuzz.sh TARGET SECONDS [RUNS]}
    if ! printf '%s\n' "${targets[@]}" | grep -qx "$target"; then
      echo "fuzz: unknown target '$target'; the targets are: ${targets[*]}" >&2
      exit 2
    fi
    build "$target"
    run "$target" "$seconds" "${3:-}"
    ;;
esac
