/* C ABI of tsd's quantize/dequantize kernels, for ctypes (Python tests and benchmarks) and other
 * languages: build/lib/libtsd_quant.so. Kinds: 0 = nf4, 1 = int8. Dtypes: 0 = fp32, 1 = bf16,
 * 2 = fp16. The formats are those of kernels/cpu/quant.h (docs/quantization.md).
 *
 * The CPU functions return 0 on success; otherwise -1 with a message (NUL-terminated, truncated
 * to err_len bytes) in `err` when err is not NULL. */
#ifndef TSD_KERNELS_CAPI_TSD_QUANT_H_
#define TSD_KERNELS_CAPI_TSD_QUANT_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Quantizes n elements of `input` (dtype) into codes ((n+1)/2 bytes for nf4, n for int8) and
 * absmax (ceil(n/block_size) floats), with the best ISA of this CPU (or TSD_KERNEL_ISA). */
int tsd_quant_quantize(int kind, const void* input, int dtype, int64_t n, int64_t block_size,
                       uint8_t* codes, float* absmax, char* err, size_t err_len);

/* Dequantizes n elements into `output` (dtype) on the CPU. */
int tsd_quant_dequantize(int kind, const uint8_t* codes, const float* absmax, int64_t n,
                         int64_t block_size, void* output, int dtype, char* err, size_t err_len);

/* Name of the ISA the CPU kernels use: "scalar", "avx2" or "avx512". */
const char* tsd_quant_cpu_isa(void);

/* 1 when this library was built with the CUDA kernels, else 0. */
int tsd_quant_has_cuda(void);

/* CUDA dequantize (kernels/cuda/dequant.h) of device buffers on `stream` (a cudaStream_t; NULL
 * is the legacy default stream). Returns the cudaError_t as an int (0 = cudaSuccess), or -1 when
 * the library was built without CUDA. Asynchronous. */
int tsd_quant_cuda_dequantize(int kind, const void* codes, const void* absmax, int64_t n,
                              int64_t block_size, void* output, int dtype, void* stream);

/* cudaGetErrorString of a code returned above ("built without CUDA" for -1). */
const char* tsd_quant_cuda_error_string(int code);

#ifdef __cplusplus
}
#endif

#endif /* TSD_KERNELS_CAPI_TSD_QUANT_H_ */
