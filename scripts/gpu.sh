#!/usr/bin/env bash
# Runs stages of work on the GPU machine (see ../shared/device/README.md), from the repository
# root of the copy the device tool sends, with .devdeps carried. Each call starts from a bare
# machine, so `build` comes first in every call:
#
#   scripts/gpu.sh build [kernels] [pytest FILE...] [peers] [finetune ARGS...] [dp ARGS...] [python SCRIPT ARGS...]
#
#   build [min [TARGET...]]  tsd, tsctl, the C++ suites, libtsd_quant and the benches (Release, into
#              /tmp/bg; `min`: only tsd, tsctl, libtsclient, libtsd_quant and stream_bench (the
#              host bandwidth finetune_bench bounds a step with), and the TARGETs named
#              after it, e.g. `build min tsd_unit_tests`), and the Python extension
#              against the machine's torch (into /tmp/tspy, linking the same build)
#   cpp [FILTER]  tsd_unit_tests' GPU and device tests (`build min tsd_unit_tests` first), $OUT/cpp_gpu.txt
#   kernels    the CUDA quantization suite, the dequantize bench, and bitsandbytes beside tsd
#              (records appended to $OUT/dequant.jsonl through bench/benchlib.py)
#   pytest     the named Python test files against that tsd and extension ($OUT/pytest.txt);
#              `pytest --cuda-tests tests/python` runs every test that a CPU machine skips for want of CUDA
#   peers      installs the carried peer wheels (DeepSpeed, torchao) into /tmp/site, and the
#              extras (bitsandbytes, TRL, datasets) where .devdeps/extras.tar.xz has them
#              (scripts/gpu-extras.sh writes it)
#   finetune   bench/finetune_bench.py with the remaining arguments, results in $OUT/finetune.jsonl
#   dp         bench/dp_bench.py (data parallel: --gpus N, --scaling 1,2,4,8, --modes ...) with the
#              remaining arguments, results in $OUT/dp.jsonl (`peers` first for ds_offload_dp)
#   python     a script with its arguments, against that tsd and extension (e.g.
#              bench/paging_memory_trace.py), its output in $OUT/python.txt
#
# Stage arguments run until the next stage name. $OUT is the device tool's output folder.
# Set TSD_BENCH_COMMIT=<commit> in the command, written out on the development machine: the
# copy's .git there may be stale, so `git rev-parse` on the GPU machine can name an old commit.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:=/tmp/out}"
mkdir -p "$OUT"
source .devdeps/device-env.sh
export TSD_BIN=/tmp/bg/bin/tsd TSD_QUANT_LIB=/tmp/bg/lib/libtsd_quant.so
export PYTHONPATH=/tmp/tspy:/tmp/site:$PWD/.devdeps/site
export TSD_BENCH_COMMIT=${TSD_BENCH_COMMIT:-unknown}
STAGES=" build kernels cpp pytest peers finetune dp python "

stage_build() {
  local t0=$SECONDS
  cmake -S . -B /tmp/bg -G Ninja -DCMAKE_BUILD_TYPE=Release >/tmp/cmake.log 2>&1 || { tail -50 /tmp/cmake.log; return 1; }
  local targets=()
  if [ "${1:-}" = min ]; then
    shift
    targets=(--target tsd tsctl tsclient tsd_quant stream_bench "$@")
  fi
  cmake --build /tmp/bg -j16 "${targets[@]}" >/tmp/build.log 2>&1 || { grep -m20 -B2 -A10 "error" /tmp/build.log; return 1; }
  rm -rf /tmp/tspy  # pip --target keeps what is there
  TSD_PY_BUILD_DIR=/tmp/bg TSD_BUILD_JOBS=16 python3 -m pip install -q --no-build-isolation --no-deps \
    --target /tmp/tspy ./client-py >/tmp/pip.log 2>&1 || { tail -40 /tmp/pip.log; return 1; }
  echo "gpu.sh: build took $((SECONDS - t0)) s"
}

stage_kernels() {
  /tmp/bg/bin/tsd_quant_cuda_tests 2>&1 | tail -5
  /tmp/bg/bin/dequant_bench 2>&1 | tail -20
  local cmd="python3 bench/dequant_bnb.py --lib build/lib/libtsd_quant.so"
  python3 bench/dequant_bnb.py --lib /tmp/bg/lib/libtsd_quant.so "$@" |
    python3 bench/benchlib.py record-lines --benchmark dequant --results "$OUT/dequant.jsonl" \
      --command "$cmd" --mode-keys bench --workload-keys elements,block_size,device,bitsandbytes,tsd_cpu_isa
}

stage_cpp() {
  # The C++ suite's GPU and device tests (or the gtest filter given), with this script's library
  # path (the carried libraries are not on the machine's own).
  /tmp/bg/bin/tsd_unit_tests --gtest_filter="${1:-*Gpu*:*Device*}" >"$OUT/cpp_gpu.txt" 2>&1 ||
    echo "gpu.sh: C++ tests failed"
  grep -E "^\[  (FAILED|PASSED) " "$OUT/cpp_gpu.txt" | head -20 || true
}

stage_pytest() {
  # -v names every test as it ends, so a run cut short by the call's time limit still says which
  # failed; the short tracebacks follow at the end.
  python3 -m pytest -v --tb=short -rfEs -p no:cacheprovider "$@" >"$OUT/pytest.txt" 2>&1 ||
    echo "gpu.sh: pytest failed"
  grep -E "(FAILED|ERROR)( |$)" "$OUT/pytest.txt" | head -40 || true
  tail -3 "$OUT/pytest.txt"
}

stage_peers() {
  mkdir -p /tmp/site
  # bitsandbytes, TRL and datasets (scripts/gpu-extras.sh packs them), where .devdeps has them.
  if [ -f .devdeps/extras.tar.xz ]; then
    tar -C /tmp/site -xJf .devdeps/extras.tar.xz
    python3 -c 'import bitsandbytes, datasets, trl; print("gpu.sh: extras", bitsandbytes.__version__, datasets.__version__, trl.__version__)' ||
      echo "gpu.sh: the extras do not import (datasets 5.2 needs pyarrow >= 24)"
  fi
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .devdeps/wheels/*.whl
  DS_BUILD_OPS=0 python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site \
    .devdeps/wheels/deepspeed-*.tar.gz
}

stage_finetune() {
  DS_SKIP_CUDA_CHECK=1 python3 bench/finetune_bench.py --peers .devdeps --tsd-bin /tmp/bg/bin/tsd \
    --results "$OUT/finetune.jsonl" "$@"
}

stage_dp() {
  DS_SKIP_CUDA_CHECK=1 python3 bench/dp_bench.py --peers .devdeps --tsd-bin /tmp/bg/bin/tsd \
    --results "$OUT/dp.jsonl" "$@"
}

stage_python() {
  python3 "$@" 2>&1 | tee -a "$OUT/python.txt" | tail -60
}

while [ $# -gt 0 ]; do
  stage=$1; shift
  case "$STAGES" in *" $stage "*) ;; *) echo "gpu.sh: unknown stage $stage" >&2; exit 2 ;; esac
  args=()
  while [ $# -gt 0 ] && [[ "$STAGES" != *" $1 "* ]]; do args+=("$1"); shift; done
  echo "== gpu.sh: $stage ${args[*]:-}"
  t0=$SECONDS
  "stage_$stage" "${args[@]}"
  echo "== gpu.sh: $stage done in $((SECONDS - t0)) s"
done
