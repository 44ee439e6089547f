// AVX2 quantize/dequantize kernels (kernels/cpu/quant.h): 8 floats per vector, 32 elements per
// step; the part of a block that does not fill a step goes through the same vector code on a
// zero-padded copy (a zero pads NF4 with the code of 0.0, exactly the format's padding). The NF4
// code is the count of midpoints below the scaled value (15 compares). Compiled with -mavx2
// -mfma -mf16c -ffp-contract=off; only called when the CPU has AVX2, FMA and F16C. Bit-identical
// to quant_scalar.cc.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/bf16.h"
#include "kernels/cpu/quant.h"
#include "kernels/cpu/with_dtype.h"

#define TSD_INLINE inline __attribute__((always_inline))

namespace tsd::kernels::detail {
namespace {

constexpr int64_t kStep = 32;  // elements per quantize step (16 NF4 bytes, 32 int8 bytes)

TSD_INLINE __m256 Load8(const void* base, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kBF16: {
      const __m128i h =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    case DType::kF16: {
      const __m128i h =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
      return _mm256_cvtph_ps(h);
    }
    default:
      return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  }
}

// Widens n (< kStep) elements starting at element i to fp32 in `dst`, zero-padded to kStep.
void LoadTail(const void* base, DType dtype, int64_t i, int64_t n, float* dst) {
  for (int64_t k = 0; k < kStep; ++k) {
    float v = 0.0f;
    if (k < n) {
      if (dtype == DType::kF32) {
        v = static_cast<const float*>(base)[i + k];
      } else {
        uint16_t h;
        std::memcpy(&h, static_cast<const uint16_t*>(base) + i + k, 2);
        v = dtype == DType::kBF16 ? Bf16ToF32(h) : F16ToF32(h);
      }
    }
    dst[k] = v;
  }
}

TSD_INLINE __m256 Abs(__m256 x) {
  return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
}

// Horizontal max of 8 non-negative floats (max is exact, so the order does not matter).
TSD_INLINE float HMax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

// max |x| over the n elements of one block starting at element i.
float BlockAbsmax(const void* input, DType dtype, int64_t i, int64_t n) {
  __m256 m = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) m = _mm256_max_ps(m, Abs(Load8(input, dtype, i + k)));
  float amax = HMax(m);
  if (k < n) {
    float tail[kStep];
    LoadTail(input, dtype, i + k, n - k, tail);
    for (int64_t j = 0; j < n - k; ++j) amax = std::max(amax, tail[j] < 0 ? -tail[j] : tail[j]);
  }
  return amax;
}

// x * factor, with +0 where x is zero (0 * Inf would be NaN when the factor overflowed).
TSD_INLINE __m256 Scale(__m256 x, __m256 factor) {
  const __m256 nonzero = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_NEQ_OQ);
  return _mm256_and_ps(_mm256_mul_ps(x, factor), nonzero);
}

// NF4 codes (0..15) of 8 scaled values: the number of midpoints strictly below each.
TSD_INLINE __m256i Nf4Codes8(__m256 s) {
  __m256i count = _mm256_setzero_si256();
  for (int k = 0; k < 15; ++k) {
    const __m256 gt = _mm256_cmp_ps(s, _mm256_set1_ps(kNf4Midpoints[k]), _CMP_GT_OQ);
    count = _mm256_sub_epi32(count, _mm256_castps_si256(gt));  // a true lane is -1
  }
  return count;
}

// 32 int32 lanes (each in 0..255 or -128..127 as chosen by kSigned) -> 32 bytes in element order.
template <bool kSigned>
TSD_INLINE __m256i PackBytes(__m256i c0, __m256i c1, __m256i c2, __m256i c3) {
  __m256i p;
  if constexpr (kSigned) {
    p = _mm256_packs_epi16(_mm256_packs_epi32(c0, c1), _mm256_packs_epi32(c2, c3));
  } else {
    p = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
  }
  return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// 32 codes (one per byte, element order) -> 16 bytes, the even element in the high nibble.
TSD_INLINE __m128i PackNibbles(__m256i bytes) {
  const __m256i t =
      _mm256_and_si256(_mm256_or_si256(_mm256_slli_epi16(bytes, 4), _mm256_srli_epi16(bytes, 8)),
                       _mm256_set1_epi16(0xFF));
  return _mm_packus_epi16(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
}

// 32 NF4 codes (16 bytes) of 32 fp32 values.
TSD_INLINE __m128i Nf4Step(const float* x, __m256 reciprocal) {
  __m256i c[4];
  for (int v = 0; v < 4; ++v) c[v] = Nf4Codes8(Scale(_mm256_loadu_ps(x + 8 * v), reciprocal));
  return PackNibbles(PackBytes<false>(c[0], c[1], c[2], c[3]));
}

template <DType D>
TSD_INLINE __m128i Nf4StepIn(const void* input, int64_t i, __m256 reciprocal) {
  __m256i c[4];
  for (int v = 0; v < 4; ++v) c[v] = Nf4Codes8(Scale(Load8(input, D, i + 8 * v), reciprocal));
  return PackNibbles(PackBytes<false>(c[0], c[1], c[2], c[3]));
}

// int8 codes of 8 values scaled by `scale`: clamp to [-127, 127], round half to even.
TSD_INLINE __m256i Int8Codes8(__m256 x, __m256 scale) {
  __m256 s = Scale(x, scale);
  s = _mm256_min_ps(_mm256_max_ps(s, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
  s = _mm256_round_ps(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm256_cvttps_epi32(s);
}

template <DType D>
void QuantizeNf4Impl(const void* input, int64_t n, int64_t block_size, uint8_t* codes,
                     float* absmax) {
  for (int64_t begin = 0, block = 0; begin < n; begin += block_size, ++block) {
    const int64_t len = std::min(block_size, n - begin);
    const float amax = BlockAbsmax(input, D, begin, len);
    absmax[block] = amax;
    // amax == 0: every element is zero and Scale gives 0, the code of 0.0.
    const __m256 reciprocal = _mm256_set1_ps(1.0f / amax);
    int64_t k = 0;
    for (; k + kStep <= len; k += kStep) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + (begin + k) / 2),
                       Nf4StepIn<D>(input, begin + k, reciprocal));
    }
    if (k < len) {
      alignas(32) float tail[kStep];
      LoadTail(input, D, begin + k, len - k, tail);
      alignas(16) uint8_t out[kStep / 2];
      _mm_store_si128(reinterpret_cast<__m128i*>(out), Nf4Step(tail, reciprocal));
      std::memcpy(codes + (begin + k) / 2, out, static_cast<size_t>((len - k + 1) / 2));
    }
  }
}

template <DType D>
void QuantizeInt8Impl(const void* input, int64_t n, int64_t block_size, uint8_t* codes,
                      float* absmax) {
  for (int64_t begin = 0, block = 0; begin < n; begin += block_size, ++block) {
    const int64_t len = std::min(block_size, n - begin);
    const float amax = BlockAbsmax(input, D, begin, len);
    absmax[block] = amax;
    const __m256 scale = _mm256_set1_ps(127.0f / amax);
    int64_t k = 0;
    for (; k + kStep <= len; k += kStep) {
      __m256i c[4];
      for (int v = 0; v < 4; ++v) c[v] = Int8Codes8(Load8(input, D, begin + k + 8 * v), scale);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + begin + k),
                          PackBytes<true>(c[0], c[1], c[2], c[3]));
    }
    if (k < len) {
      alignas(32) float tail[kStep];
      LoadTail(input, D, begin + k, len - k, tail);
      __m256i c[4];
      for (int v = 0; v < 4; ++v) c[v] = Int8Codes8(_mm256_load_ps(tail + 8 * v), scale);
      alignas(32) uint8_t out[kStep];
      _mm256_store_si256(reinterpret_cast<__m256i*>(out), PackBytes<true>(c[0], c[1], c[2], c[3]));
      std::memcpy(codes + begin + k, out, static_cast<size_t>(len - k));
    }
  }
}

// ---- dequantize ---------------------------------------------------------------------------

constexpr int64_t kDqStep = 16;  // elements per dequantize step

// F32ToBf16Rne of bf16.h on 8 lanes, packed to 8 x 16 bits.
TSD_INLINE __m128i F32ToBf16Rne8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  r = _mm256_blendv_epi8(r, quiet, nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// Stores 8 values at element i of `out` converted to D.
template <DType D>
TSD_INLINE void Store8(void* out, int64_t i, __m256 v) {
  if constexpr (D == DType::kF32) {
    _mm256_storeu_ps(static_cast<float*>(out) + i, v);
  } else if constexpr (D == DType::kBF16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i), F32ToBf16Rne8(v));
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// Code values of 8 NF4 codes (int32 lanes 0..15): two 8-entry table lookups, chosen by bit 3.
TSD_INLINE __m256 Nf4Values8(__m256i code) {
  const __m256 lo = _mm256_permutevar8x32_ps(_mm256_loadu_ps(kNf4Values), code);
  const __m256 hi = _mm256_permutevar8x32_ps(_mm256_loadu_ps(kNf4Values + 8), code);
  return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(code, 28)));
}

// 16 elements from the 8 code bytes at `codes`, times `scale`, stored at element i of out.
template <DType D>
TSD_INLINE void Nf4DqStep(const uint8_t* codes, __m256 scale, void* out, int64_t i) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  const __m128i lo = _mm_and_si128(bytes, mask);
  const __m128i nibbles = _mm_unpacklo_epi8(hi, lo);  // element order
  const __m256i c0 = _mm256_cvtepu8_epi32(nibbles);
  const __m256i c1 = _mm256_cvtepu8_epi32(_mm_srli_si128(nibbles, 8));
  Store8<D>(out, i, _mm256_mul_ps(Nf4Values8(c0), scale));
  Store8<D>(out, i + 8, _mm256_mul_ps(Nf4Values8(c1), scale));
}

template <DType D>
TSD_INLINE void Int8DqStep(const uint8_t* codes, __m256 scale, void* out, int64_t i) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
  Store8<D>(out, i, _mm256_mul_ps(q0, scale));
  Store8<D>(out, i + 8, _mm256_mul_ps(q1, scale));
}

template <DType D, bool kNf4>
void DequantizeImpl(const uint8_t* codes, const float* absmax, int64_t n, int64_t block_size,
                    void* output) {
  const size_t out_size = DTypeSize(D);
  for (int64_t begin = 0, block = 0; begin < n; begin += block_size, ++block) {
    const int64_t len = std::min(block_size, n - begin);
    const __m256 scale = _mm256_set1_ps(kNf4 ? absmax[block] : absmax[block] / 127.0f);
    int64_t k = 0;
    for (; k + kDqStep <= len; k += kDqStep) {
      if constexpr (kNf4) {
        Nf4DqStep<D>(codes + (begin + k) / 2, scale, output, begin + k);
      } else {
        Int8DqStep<D>(codes + begin + k, scale, output, begin + k);
      }
    }
    if (k < len) {
      const int64_t rest = len - k;
      alignas(16) uint8_t in[kDqStep] = {};
      alignas(32) unsigned char out[kDqStep * 4];
      if constexpr (kNf4) {
        std::memcpy(in, codes + (begin + k) / 2, static_cast<size_t>((rest + 1) / 2));
        Nf4DqStep<D>(in, scale, out, 0);
      } else {
        std::memcpy(in, codes + begin + k, static_cast<size_t>(rest));
        Int8DqStep<D>(in, scale, out, 0);
      }
      std::memcpy(static_cast<unsigned char*>(output) + (begin + k) * out_size, out,
                  static_cast<size_t>(rest) * out_size);
    }
  }
}

template <bool kNf4>
void DequantizeDispatch(const uint8_t* codes, const float* absmax, int64_t n, int64_t block_size,
                        void* output, DType dtype) {
  return WithDType(dtype, [&](auto k) {
    return DequantizeImpl<decltype(k)::value, kNf4>(codes, absmax, n, block_size, output);
  });
}

}  // namespace

void QuantizeNf4Avx2(const void* input, DType dtype, int64_t n, int64_t block_size, uint8_t* codes,
                     float* absmax) {
  return WithDType(dtype, [&](auto k) {
    return QuantizeNf4Impl<decltype(k)::value>(input, n, block_size, codes, absmax);
  });
}

void QuantizeInt8Avx2(const void* input, DType dtype, int64_t n, int64_t block_size, uint8_t* codes,
                      float* absmax) {
  return WithDType(dtype, [&](auto k) {
    return QuantizeInt8Impl<decltype(k)::value>(input, n, block_size, codes, absmax);
  });
}

void DequantizeNf4Avx2(const uint8_t* codes, const float* absmax, int64_t n, int64_t block_size,
                       void* output, DType dtype) {
  DequantizeDispatch<true>(codes, absmax, n, block_size, output, dtype);
}

void DequantizeInt8Avx2(const uint8_t* codes, const float* absmax, int64_t n, int64_t block_size,
                        void* output, DType dtype) {
  DequantizeDispatch<false>(codes, absmax, n, block_size, output, dtype);
}

int64_t FindNonFiniteAvx2(const void* input, DType dtype, int64_t n) {
  int64_t i = 0;
  if (dtype == DType::kF32) {
    const float* x = static_cast<const float*>(input);
    const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
    const __m256i largest = _mm256_set1_epi32(0x7F7FFFFF);  // largest finite, as bits
    for (; i + 8 <= n; i += 8) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
      if (!_mm256_testz_si256(_mm256_cmpgt_epi32(_mm256_and_si256(bits, abs_mask), largest),
                              _mm256_set1_epi32(-1))) {
        break;
      }
    }
  } else {
    const uint16_t* x = static_cast<const uint16_t*>(input);
    const __m256i abs_mask = _mm256_set1_epi16(0x7FFF);
    const __m256i largest = _mm256_set1_epi16(dtype == DType::kBF16 ? 0x7F7F : 0x7BFF);
    for (; i + 16 <= n; i += 16) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
      if (!_mm256_testz_si256(_mm256_cmpgt_epi16(_mm256_and_si256(bits, abs_mask), largest),
                              _mm256_set1_epi32(-1))) {
        break;
      }
    }
  }
  // The rest (or the vector that had a non-finite lane) element by element.
  const size_t size = DTypeSize(dtype);
  const int64_t found =
      FindNonFiniteScalar(static_cast<const unsigned char*>(input) + i * size, dtype, n - i);
  return found < 0 ? -1 : i + found;
}

}  // namespace tsd::kernels::detail
