#!/usr/bin/env bash
# Packs the Python packages the GPU machine lacks and the CUDA tests and benchmarks use besides the
# peers of .devdeps/wheels: bitsandbytes (#11's QLoRA and dequantize comparisons; only its CUDA 13
# and CPU libraries are kept, the wheel's other fifteen builds are 110 MB), and TRL with `datasets`
# and their two missing dependencies (the SFTTrainer test on CUDA; the machine has pandas, pyarrow,
# accelerate, xxhash and fsspec). The result, .devdeps/extras.tar.xz (about 4.5 MB), travels with
# .devdeps; `scripts/gpu.sh peers` unpacks it into /tmp/site there.
#   scripts/gpu-extras.sh            writes .devdeps/extras.tar.xz (needs pip and network here)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .devdeps ] || { echo "gpu-extras: no .devdeps here (../shared/device/README.md makes it)" >&2; exit 1; }
pip=(.venv/bin/python -m pip)
tmp=$(mktemp -d /tmp/gpu-extras.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
platform=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
          --platform any --only-binary=:all: --no-deps)
"${pip[@]}" download -q "${platform[@]}" -d "$tmp/whl" bitsandbytes==0.50.2 trl==1.16.0 datasets==5.2.0 \
  dill==0.4.1 multiprocess==0.70.19
"${pip[@]}" install -q "${platform[@]}" --target "$tmp/site" "$tmp"/whl/*.whl
find "$tmp/site/bitsandbytes" -name 'libbitsandbytes_*.so' ! -name '*_cuda130.so' ! -name '*_cpu.so' -delete
find "$tmp/site" -name __pycache__ -type d -prune -exec rm -rf {} +
rm -rf "$tmp/site/bin"
tar -C "$tmp/site" -cf - . | xz -9 > .devdeps/extras.tar.xz
echo "gpu-extras: .devdeps/extras.tar.xz ($(du -h .devdeps/extras.tar.xz | cut -f1)): $(ls "$tmp/whl" | tr '\n' ' ')"
