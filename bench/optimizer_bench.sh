#!/usr/bin/env bash
# The optimizer engine's benchmarks, side by side with torch's CPU AdamW in one run.
#   bench/optimizer_bench.sh [BUILD_DIR] [PARAMS]      (defaults: build, 256000000)
# Starts its own tsd on a temporary socket, runs build/bin/optimizer_bench (stream bandwidth,
# engine throughput with fp32 and bf16 moments, doorbell vs gRPC latency), then the torch peers
# (fused and foreach) when python3 has torch. Every line printed is one JSON object, and each is
# appended as one record to bench/results/optimizer.jsonl (or $RESULTS) through bench/benchlib.py,
# for bench/report.py and docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
params=${2:-256000000}
dir=$(mktemp -d /tmp/tsd-bench-XXXXXX)
pool=$(( params * 18 / 1024 / 1024 / 1024 + 2 ))GiB
"$build/bin/tsd" --socket "$dir/tsd.sock" --pool-size "$pool" --metrics-listen "" --log-level warn &
tsd_pid=$!
trap 'kill -TERM $tsd_pid 2>/dev/null; wait $tsd_pid 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 100); do "$build/bin/tsctl" --socket "$dir/tsd.sock" status >/dev/null 2>&1 && break; sleep 0.1; done
results=(); [ -n "${RESULTS:-}" ] && results=(--results "$RESULTS")
{
  "$build/bin/optimizer_bench" --socket "$dir/tsd.sock" --params "$params"
  if python3 -c 'import torch' 2>/dev/null; then
    python3 bench/torch_adamw_cpu.py --params "$params" --impl fused
    python3 bench/torch_adamw_cpu.py --params "$params" --impl foreach
  else
    echo '{"bench": "torch_adamw_cpu", "skipped": "python3 has no torch"}'
  fi
} | python3 bench/benchlib.py record-lines --benchmark optimizer "${results[@]}" \
      --command "bench/optimizer_bench.sh $build $params" --mode-keys bench,moments,impl \
      --workload-keys params,threads,daemon_threads,buckets,iters,isa,torch,bytes_per_param --workload "build=$build"
