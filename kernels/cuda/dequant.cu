// Host launchers of the CUDA dequantize kernels (kernels/cuda/dequant.h): argument checks and
// the choice of kernel instantiation (output type, format, one absmax per chunk or not,
// vectorised or not).
#include <cstdint>

#include "kernels/cuda/dequant.cuh"
#include "kernels/cuda/dequant.h"

namespace tsd::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxGrid = 1 << 30;              // grid-stride beyond this many thread blocks
constexpr int64_t kMaxWordGrid = (1ll << 31) - 1;  // the word kernel has no grid stride

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <typename OutT, bool kNf4>
cudaError_t Launch(const uint8_t* codes, const float* absmax, int64_t n, int64_t block_size,
                   void* output, cudaStream_t stream) {
  constexpr int64_t kElems = ChunkElements<kNf4>();
  const int64_t code_bytes = kNf4 ? (n + 1) / 2 : n;
  const int64_t chunks = (code_bytes + kChunkBytes - 1) / kChunkBytes;
  int64_t grid = (chunks + kThreads - 1) / kThreads;
  if (grid > kMaxGrid) grid = kMaxGrid;
  const bool uniform = block_size % kElems == 0;
  const bool aligned = Aligned16(codes) && Aligned16(output);
  OutT* out = static_cast<OutT*>(output);
  // The coalesced word kernel where its layout applies (the usual case: block 64, tensors from
  // an allocator); the chunked kernels below for everything else.
  constexpr int64_t kWordElems = kNf4 ? 8 : 4;
  const uintptr_t store_align = kWordElems * sizeof(OutT) >= 16 ? 16 : kWordElems * sizeof(OutT);
  if (block_size % kWordElems == 0 && (reinterpret_cast<uintptr_t>(codes) & 3u) == 0 &&
      (reinterpret_cast<uintptr_t>(output) & (store_align - 1)) == 0) {
    const int64_t words = n / kWordElems;
    const int64_t per_block = static_cast<int64_t>(kThreads) * kWordUnroll;
    const int64_t word_grid = words > 0 ? (words + per_block - 1) / per_block : 1;
    if (word_grid <= kMaxWordGrid) {
      DequantizeWordsKernel<OutT, kNf4><<<static_cast<unsigned>(word_grid), kThreads, 0, stream>>>(
          codes, absmax, n, block_size, out);
      return cudaGetLastError();
    }
  }
  const dim3 blocks(static_cast<unsigned>(grid));
  if (uniform && aligned) {
    DequantizeKernel<OutT, kNf4, true, true>
        <<<blocks, kThreads, 0, stream>>>(codes, absmax, n, block_size, out);
  } else if (uniform) {
    DequantizeKernel<OutT, kNf4, true, false>
        <<<blocks, kThreads, 0, stream>>>(codes, absmax, n, block_size, out);
  } else if (aligned) {
    DequantizeKernel<OutT, kNf4, false, true>
        <<<blocks, kThreads, 0, stream>>>(codes, absmax, n, block_size, out);
  } else {
    DequantizeKernel<OutT, kNf4, false, false>
        <<<blocks, kThreads, 0, stream>>>(codes, absmax, n, block_size, out);
  }
  return cudaGetLastError();
}

template <bool kNf4>
cudaError_t LaunchFor(DType dtype, const uint8_t* codes, const float* absmax, int64_t n,
                      int64_t block_size, void* output, cudaStream_t stream) {
  switch (dtype) {
    case DType::kF32:
      return Launch<float, kNf4>(codes, absmax, n, block_size, output, stream);
    case DType::kBF16:
      return Launch<__nv_bfloat16, kNf4>(codes, absmax, n, block_size, output, stream);
    case DType::kF16:
      return Launch<__half, kNf4>(codes, absmax, n, block_size, output, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t DequantizeAsync(QuantKind kind, const uint8_t* codes, const float* absmax, int64_t n,
                            int64_t block_size, void* output, DType dtype, cudaStream_t stream) {
  if (n < 0 || block_size < 1) return cudaErrorInvalidValue;
  if (kind != QuantKind::kNf4 && kind != QuantKind::kInt8) return cudaErrorInvalidValue;
  if (kind == QuantKind::kNf4 && block_size % 2 != 0) return cudaErrorInvalidValue;
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16) {
    return cudaErrorInvalidValue;
  }
  if (n == 0) return cudaSuccess;
  if (codes == nullptr || absmax == nullptr || output == nullptr) return cudaErrorInvalidValue;
  return kind == QuantKind::kNf4
             ? LaunchFor<true>(dtype, codes, absmax, n, block_size, output, stream)
             : LaunchFor<false>(dtype, codes, absmax, n, block_size, output, stream);
}

}  // namespace tsd::kernels::cuda
