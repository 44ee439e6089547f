// CUDA dequantize kernels of tsd: NF4 and int8 codes with fp32 block absmax (kernels/cpu/quant.h)
// to fp32, bf16 or fp16. Included by dequant.cu (the launchers, kernels/cuda/dequant.h); usable
// from other .cu files that want to fuse the dequantization into their own kernels.
//
// Work split: each thread owns one 16-byte chunk of codes (32 NF4 elements or 16 int8 elements),
// reads it with one 16-byte load and writes its outputs with 16-byte stores. When the block size
// is a multiple of the chunk's element count (the default 64 is), a chunk lies in one block and
// its absmax is read once; otherwise the thread walks the block boundaries inside its chunk.
// Unaligned buffers and the last, partial chunk take byte/element-wise loads and stores.
//
// Arithmetic, exactly as the CPU reference: NF4 value = table[code] * absmax (fp32), int8 value =
// float(q) * (absmax / 127.0f) (IEEE division; the file must not be built with --use_fast_math
// or -prec-div=false), then round-to-nearest-even to bf16/fp16 (__float2bfloat16_rn,
// __float2half_rn, which keep subnormals).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cpu/quant_format.h"

namespace tsd::kernels::cuda {

// The 16 NF4 code values, copied into shared memory by each thread block.
static __constant__ float kNf4Table[16] = {
    detail::kNf4Values[0],  detail::kNf4Values[1],  detail::kNf4Values[2],  detail::kNf4Values[3],
    detail::kNf4Values[4],  detail::kNf4Values[5],  detail::kNf4Values[6],  detail::kNf4Values[7],
    detail::kNf4Values[8],  detail::kNf4Values[9],  detail::kNf4Values[10], detail::kNf4Values[11],
    detail::kNf4Values[12], detail::kNf4Values[13], detail::kNf4Values[14], detail::kNf4Values[15],
};

constexpr int kChunkBytes = 16;  // bytes of codes per thread

template <bool kNf4>
__host__ __device__ constexpr int ChunkElements() {
  return kNf4 ? 2 * kChunkBytes : kChunkBytes;
}

// Rounds one value to OutT (nearest even).
template <typename OutT>
__device__ __forceinline__ OutT Convert(float v);
template <>
__device__ __forceinline__ float Convert<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 Convert<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half Convert<__half>(float v) {
  return __float2half_rn(v);
}

// Two values rounded to OutT (2 bytes each) in one 32-bit word, `lo` at the lower address.
template <typename OutT>
__device__ __forceinline__ uint32_t PackPair(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t PackPair<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);  // .x = lo, .y = hi
  return static_cast<uint32_t>(__bfloat16_as_ushort(pair.x)) |
         (static_cast<uint32_t>(__bfloat16_as_ushort(pair.y)) << 16);
}
template <>
__device__ __forceinline__ uint32_t PackPair<__half>(float lo, float hi) {
  const __half2 pair = __floats2half2_rn(lo, hi);
  return static_cast<uint32_t>(__half_as_ushort(pair.x)) |
         (static_cast<uint32_t>(__half_as_ushort(pair.y)) << 16);
}

// Stores values[0..kCount) as OutT at `dst` (16-byte aligned) with 16-byte stores.
template <typename OutT, int kCount>
__device__ __forceinline__ void StoreVector(OutT* dst, const float (&values)[kCount]) {
  constexpr int kPerWord = 16 / static_cast<int>(sizeof(OutT));
  static_assert(kCount % kPerWord == 0);
  uint4* out = reinterpret_cast<uint4*>(dst);
#pragma unroll
  for (int w = 0; w < kCount / kPerWord; ++w) {
    uint32_t word[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (sizeof(OutT) == 4) {
        word[k] = __float_as_uint(values[w * kPerWord + k]);
      } else {
        word[k] = PackPair<OutT>(values[w * kPerWord + 2 * k], values[w * kPerWord + 2 * k + 1]);
      }
    }
    out[w] = make_uint4(word[0], word[1], word[2], word[3]);
  }
}

// The code value (before scaling) of element k of a chunk whose 16 code bytes are `words`
// (little-endian, byte b in words[b / 4]).
template <bool kNf4>
__device__ __forceinline__ float CodeValue(const uint32_t (&words)[4], int k, const float* table) {
  if constexpr (kNf4) {
    const int byte_index = k / 2;
    const uint32_t byte = (words[byte_index / 4] >> (8 * (byte_index % 4))) & 0xFFu;
    return table[(k % 2 == 0) ? (byte >> 4) : (byte & 0x0Fu)];
  } else {
    const uint32_t byte = (words[k / 4] >> (8 * (k % 4))) & 0xFFu;
    return static_cast<float>(static_cast<int8_t>(byte));
  }
}

// The code value (before scaling) of element k of a 4-byte word of codes (byte b in bits 8b..8b+7;
// for NF4 the even element in the high nibble).
template <bool kNf4>
__device__ __forceinline__ float WordCodeValue(uint32_t word, int k, const float* table) {
  if constexpr (kNf4) {
    const uint32_t byte = (word >> (8 * (k / 2))) & 0xFFu;
    return table[(k % 2 == 0) ? (byte >> 4) : (byte & 0x0Fu)];
  } else {
    return static_cast<float>(static_cast<int8_t>((word >> (8 * k)) & 0xFFu));
  }
}

// Stores the outputs of one word of codes: 8 or 4 values, 8 to 32 bytes, with vector stores.
template <typename OutT, int kCount>
__device__ __forceinline__ void StoreWordOutputs(OutT* dst, const float (&values)[kCount]) {
  if constexpr (kCount * sizeof(OutT) % 16 == 0) {
    StoreVector<OutT, kCount>(dst, values);
  } else {
    static_assert(kCount == 4 && sizeof(OutT) == 2);
    *reinterpret_cast<uint2*>(dst) =
        make_uint2(PackPair<OutT>(values[0], values[1]), PackPair<OutT>(values[2], values[3]));
  }
}

// The bandwidth path: thread t of a thread block handles words t, t + blockDim.x, ... of the
// block's kWordUnroll * blockDim.x consecutive 4-byte words of codes, so a warp's loads and its
// stores each cover one contiguous span (a 16-byte output per lane for NF4 -> bf16). All loads of
// a thread are issued before any store. Needs: block_size a multiple of the word's element count,
// codes 4-byte aligned, output aligned to its per-word store. The last n % (elements per word)
// elements (the tail) are done one by one by the first threads of thread block 0.
constexpr int kWordUnroll = 4;

template <typename OutT, bool kNf4>
__global__ void __launch_bounds__(256)
    DequantizeWordsKernel(const uint8_t* __restrict__ codes, const float* __restrict__ absmax,
                          int64_t n, int64_t block_size, OutT* __restrict__ output) {
  constexpr int kPerWord = kNf4 ? 8 : 4;
  __shared__ float table[16];
  if constexpr (kNf4) {
    if (threadIdx.x < 16) table[threadIdx.x] = kNf4Table[threadIdx.x];
    __syncthreads();
  }
  const int64_t words = n / kPerWord;
  const auto* code_words = reinterpret_cast<const uint32_t*>(codes);
  const int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x * kWordUnroll + threadIdx.x;
  uint32_t w[kWordUnroll];
  float a[kWordUnroll];
#pragma unroll
  for (int j = 0; j < kWordUnroll; ++j) {
    const int64_t i = base + static_cast<int64_t>(j) * blockDim.x;
    if (i < words) {
      w[j] = __ldcs(code_words + i);
      a[j] = __ldg(absmax + (i * kPerWord) / block_size);
    }
  }
#pragma unroll
  for (int j = 0; j < kWordUnroll; ++j) {
    const int64_t i = base + static_cast<int64_t>(j) * blockDim.x;
    if (i < words) {
      const float scale = kNf4 ? a[j] : a[j] / 127.0f;
      float v[kPerWord];
#pragma unroll
      for (int k = 0; k < kPerWord; ++k)
        v[k] = __fmul_rn(WordCodeValue<kNf4>(w[j], k, table), scale);
      StoreWordOutputs<OutT, kPerWord>(output + i * kPerWord, v);
    }
  }
  if (blockIdx.x == 0 && threadIdx.x < n - words * kPerWord) {
    const int64_t e = words * kPerWord + threadIdx.x;
    const float a_e = __ldg(absmax + e / block_size);
    float code;
    if constexpr (kNf4) {
      const uint32_t byte = codes[e / 2];
      code = table[(e % 2 == 0) ? (byte >> 4) : (byte & 0x0Fu)];
    } else {
      code = static_cast<float>(static_cast<int8_t>(codes[e]));
    }
    output[e] = Convert<OutT>(__fmul_rn(code, kNf4 ? a_e : a_e / 127.0f));
  }
}

// The dequantize kernel. kUniform: block_size is a multiple of the chunk's element count, so a
// chunk has one absmax. kAligned: codes and output are 16-byte aligned (vector loads/stores for
// whole chunks).
template <typename OutT, bool kNf4, bool kUniform, bool kAligned>
__global__ void __launch_bounds__(256)
    DequantizeKernel(const uint8_t* __restrict__ codes, const float* __restrict__ absmax, int64_t n,
                     int64_t block_size, OutT* __restrict__ output) {
  constexpr int kElems = ChunkElements<kNf4>();
  constexpr int kPerWord = 16 / static_cast<int>(sizeof(OutT));  // outputs per 16-byte store
  __shared__ float table[16];
  if constexpr (kNf4) {
    if (threadIdx.x < 16) table[threadIdx.x] = kNf4Table[threadIdx.x];
    __syncthreads();
  }
  const int64_t code_bytes = kNf4 ? (n + 1) / 2 : n;
  const int64_t chunks = (code_bytes + kChunkBytes - 1) / kChunkBytes;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t chunk = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; chunk < chunks;
       chunk += stride) {
    const int64_t first_byte = chunk * kChunkBytes;
    const int64_t first = chunk * kElems;  // first element
    const bool whole = first + kElems <= n;
    int64_t block = first / block_size;

    if (kUniform && kAligned && whole) {
      // The hot path: one 16-byte load, one absmax, 16-byte stores as soon as each is ready.
      const uint4 v = __ldcs(reinterpret_cast<const uint4*>(codes + first_byte));
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
      const float a = __ldg(absmax + block);
      const float scale = kNf4 ? a : a / 127.0f;
      uint4* out = reinterpret_cast<uint4*>(output + first);
#pragma unroll
      for (int w = 0; w < kElems / kPerWord; ++w) {
        uint32_t packed[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int e = w * kPerWord + k * (kPerWord / 4);
          if constexpr (sizeof(OutT) == 4) {
            packed[k] = __float_as_uint(__fmul_rn(CodeValue<kNf4>(words, e, table), scale));
          } else {
            packed[k] = PackPair<OutT>(__fmul_rn(CodeValue<kNf4>(words, e, table), scale),
                                       __fmul_rn(CodeValue<kNf4>(words, e + 1, table), scale));
          }
        }
        out[w] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      }
      continue;
    }

    // The chunk's 16 code bytes as four little-endian words.
    uint32_t words[4];
    if (kAligned && whole) {
      const uint4 v = __ldcs(reinterpret_cast<const uint4*>(codes + first_byte));
      words[0] = v.x;
      words[1] = v.y;
      words[2] = v.z;
      words[3] = v.w;
    } else {
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        uint32_t word = 0;
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          const int64_t at = first_byte + 4 * w + b;
          if (at < code_bytes) word |= static_cast<uint32_t>(codes[at]) << (8 * b);
        }
        words[w] = word;
      }
    }

    // Per-element scale: one absmax for the chunk, or walked across block boundaries.
    int64_t next_boundary = (block + 1) * block_size;
    float scale = kNf4 ? __ldg(absmax + block) : __ldg(absmax + block) / 127.0f;
    float values[kElems];
#pragma unroll
    for (int k = 0; k < kElems; ++k) {
      if constexpr (!kUniform) {
        if (first + k == next_boundary && first + k < n) {
          ++block;
          next_boundary += block_size;
          scale = kNf4 ? __ldg(absmax + block) : __ldg(absmax + block) / 127.0f;
        }
      }
      values[k] = __fmul_rn(CodeValue<kNf4>(words, k, table), scale);
    }

    if (kAligned && whole) {
      StoreVector<OutT, kElems>(output + first, values);
    } else {
#pragma unroll
      for (int k = 0; k < kElems; ++k) {
        if (first + k < n) output[first + k] = Convert<OutT>(values[k]);
      }
    }
  }
}

}  // namespace tsd::kernels::cuda
