// Host launchers of the CUDA dequantize kernels of tsd (kernels/cuda/dequant.cuh): NF4 and int8
// codes with fp32 block absmax, as kernels/cpu/quant.h defines them, to fp32, bf16 or fp16 on
// the GPU. Framework-free (CUDA runtime only): the Python extension calls these with torch's
// pointers and stream, the tests and benchmarks with their own.
//
// Results are bit-identical to the CPU kernels (tsd::kernels::Dequantize) for every input whose
// products are not NaN; a NaN (only possible from a NaN absmax, which Quantize never writes) is
// converted to the canonical bf16/fp16 NaN by CUDA, while the CPU keeps its payload.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cpu/adamw.h"  // DType
#include "kernels/cpu/quant_format.h"

namespace tsd::kernels::cuda {

// Dequantizes the `n` elements of one quantized tensor into `output` (n elements of `dtype`),
// asynchronously on `stream`. `codes` (QuantCodeBytes(kind, n) bytes), `absmax`
// (ceil(n / block_size) floats) and `output` are device (or managed/mapped) pointers; they must
// not overlap. Any alignment works; 16-byte aligned `codes` and `output` take the vectorised path.
//
// Returns cudaErrorInvalidValue, launching nothing, for: n < 0, block_size < 1, an odd block_size
// for NF4, an unknown kind or dtype, or a null pointer while n > 0. Otherwise the error of the
// launch itself (cudaGetLastError()); errors of the kernel's execution appear on the stream as
// usual. n == 0 launches nothing and returns cudaSuccess.
cudaError_t DequantizeAsync(QuantKind kind, const uint8_t* codes, const float* absmax, int64_t n,
                            int64_t block_size, void* output, DType dtype, cudaStream_t stream);

}  // namespace tsd::kernels::cuda
