// AVX-512 quantize/dequantize kernels (kernels/cpu/quant.h): 16 floats per vector, masked loads
// and stores for the part of a block that does not fill a step (masked-off lanes load as zero,
// which codes NF4 padding as the code of 0.0, as the format says). The NF4 code is found by a
// 4-step binary search over the midpoint table with VPERMPS (a different algorithm from the
// scalar and AVX2 paths, same result). Compiled with -mavx512f -mavx512bw -mavx512vl -mavx2
// -mfma -mf16c -ffp-contract=off; only called when the CPU has AVX-512 F/BW/VL. Bit-identical
// to quant_scalar.cc.

// GCC 12 reports false "-Wmaybe-uninitialized" inside AVX-512 intrinsics that use
// _mm512_undefined_* (GCC bug 105593); silence it for this file only.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cpu/quant.h"
#include "kernels/cpu/with_dtype.h"

#define TSD_INLINE inline __attribute__((always_inline))

namespace tsd::kernels::detail {
namespace {

constexpr int64_t kStep = 32;  // elements per quantize/dequantize step (two vectors)

// Lanes [0, n) set (none for n <= 0, all for n >= 16).
TSD_INLINE __mmask16 Mask16(int64_t n) {
  if (n <= 0) return 0;
  return n >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << n) - 1u);
}

// 16 elements at element i as fp32; lanes outside `k` are 0.
template <DType D>
TSD_INLINE __m512 Load16(const void* base, int64_t i, __mmask16 k) {
  if constexpr (D == DType::kF32) {
    return _mm512_maskz_loadu_ps(k, static_cast<const float*>(base) + i);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(base) + i);
    if constexpr (D == DType::kBF16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

TSD_INLINE __m512 Abs(__m512 x) {
  return _mm512_castsi512_ps(
      _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF)));
}

template <DType D>
float BlockAbsmax(const void* input, int64_t i, int64_t n) {
  __m512 m = _mm512_setzero_ps();
  for (int64_t k = 0; k < n; k += 16)
    m = _mm512_max_ps(m, Abs(Load16<D>(input, i + k, Mask16(n - k))));
  return _mm512_reduce_max_ps(m);
}

// x * factor, with +0 where x is zero (0 * Inf would be NaN when the factor overflowed).
TSD_INLINE __m512 Scale(__m512 x, __m512 factor) {
  const __mmask16 nonzero = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_NEQ_OQ);
  return _mm512_maskz_mul_ps(nonzero, x, factor);
}

// NF4 codes of 16 scaled values, as bytes: binary search for the number of midpoints below s.
TSD_INLINE __m128i Nf4Codes16(__m512 s, __m512 midpoints) {
  __m512i code = _mm512_setzero_si512();
  for (int step = 8; step >= 1; step /= 2) {
    const __m512i probe = _mm512_add_epi32(code, _mm512_set1_epi32(step - 1));
    const __m512 m = _mm512_permutexvar_ps(probe, midpoints);
    const __mmask16 above = _mm512_cmp_ps_mask(s, m, _CMP_GT_OQ);
    code = _mm512_mask_add_epi32(code, above, code, _mm512_set1_epi32(step));
  }
  return _mm512_cvtepi32_epi8(code);
}

// Two vectors of 16 codes (one per byte) -> 16 bytes, the even element in the high nibble.
TSD_INLINE __m128i PackNibbles(__m128i a, __m128i b) {
  const __m128i mask = _mm_set1_epi16(0xFF);
  const __m128i ta = _mm_and_si128(_mm_or_si128(_mm_slli_epi16(a, 4), _mm_srli_epi16(a, 8)), mask);
  const __m128i tb = _mm_and_si128(_mm_or_si128(_mm_slli_epi16(b, 4), _mm_srli_epi16(b, 8)), mask);
  return _mm_packus_epi16(ta, tb);
}

template <DType D>
void QuantizeNf4Impl(const void* input, int64_t n, int64_t block_size, uint8_t* codes,
                     float* absmax) {
  const __m512 midpoints = _mm512_loadu_ps(kNf4Midpoints);
  for (int64_t begin = 0, block = 0; begin < n; begin += block_size, ++block) {
    const int64_t len = std::min(block_size, n - begin);
    const float amax = BlockAbsmax<D>(input, begin, len);
    absmax[block] = amax;
    // amax == 0: every element is zero and Scale gives 0, the code of 0.0.
    const __m512 reciprocal = _mm512_set1_ps(1.0f / amax);
    for (int64_t k = 0; k < len; k += kStep) {
      const int64_t rest = len - k;
      const __m128i a =
          Nf4Codes16(Scale(Load16<D>(input, begin + k, Mask16(rest)), reciprocal), midpoints);
      const __m128i b = Nf4Codes16(
          Scale(Load16<D>(input, begin + k + 16, Mask16(rest - 16)), reciprocal), midpoints);
      const __m128i packed = PackNibbles(a, b);
      uint8_t* dst = codes + (begin + k) / 2;
      if (rest >= kStep) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), packed);
      } else {
        _mm_mask_storeu_epi8(dst, Mask16((rest + 1) / 2), packed);
      }
    }
  }
}

template <DType D>
void QuantizeInt8Impl(const void* input, int64_t n, int64_t block_size, uint8_t* codes,
                      float* absmax) {
  for (int64_t begin = 0, block = 0; begin < n; begin += block_size, ++block) {
    const int64_t len = std::min(block_size, n - begin);
    const float amax = BlockAbsmax<D>(input, begin, len);
    absmax[block] = amax;
    const __m512 scale = _mm512_set1_ps(127.0f / amax);
    for (int64_t k = 0; k < len; k += 16) {
      const __mmask16 m = Mask16(len - k);
      __m512 s = Scale(Load16<D>(input, begin + k, m), scale);
      s = _mm512_min_ps(_mm512_max_ps(s, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
      s = _mm512_roundscale_ps(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_mask_storeu_epi8(codes + begin + k, m, _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(s)));
    }
  }
}

// ---- dequantize ---------------------------------------------------------------------------

// F32ToBf16Rne of bf16.h with integer operations (VCVTNEPS2BF16 would flush subnormals).
TSD_INLINE __m256i F32ToBf16Rne16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  r = _mm512_mask_mov_epi32(r, nan, quiet);
  return _mm512_cvtepi32_epi16(r);
}

// Stores the lanes `k` of v at element i of `out`, converted to D.
template <DType D>
TSD_INLINE void Store16(void* out, int64_t i, __m512 v, __mmask16 k) {
  if constexpr (D == DType::kF32) {
    _mm512_mask_storeu_ps(static_cast<float*>(out) + i, k, v);
  } else if constexpr (D == DType::kBF16) {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + i, k, F32ToBf16Rne16(v));
  } else {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + i, k,
                             _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

template <DType D>
void DequantizeNf4Impl(const uint8_t* codes, const float* absmax, int64_t n, int64_t block_size,
                       void* output) {
  const __m512 values = _mm512_loadu_ps(kNf4Values);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t begin = 0, block = 0; begin < n; begin += block_size, ++block) {
    const int64_t len = std::min(block_size, n - begin);
    const __m512 scale = _mm512_set1_ps(absmax[block]);
    for (int64_t k = 0; k < len; k += kStep) {
      const int64_t rest = len - k;
      const uint8_t* src = codes + (begin + k) / 2;
      const __m128i bytes = rest >= kStep ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(src))
                                          : _mm_maskz_loadu_epi8(Mask16((rest + 1) / 2), src);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
      const __m128i lo = _mm_and_si128(bytes, low4);
      const __m512i c0 = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(hi, lo));
      const __m512i c1 = _mm512_cvtepu8_epi32(_mm_unpackhi_epi8(hi, lo));
      Store16<D>(output, begin + k, _mm512_mul_ps(_mm512_permutexvar_ps(c0, values), scale),
                 Mask16(rest));
      Store16<D>(output, begin + k + 16, _mm512_mul_ps(_mm512_permutexvar_ps(c1, values), scale),
                 Mask16(rest - 16));
    }
  }
}

template <DType D>
void DequantizeInt8Impl(const uint8_t* codes, const float* absmax, int64_t n, int64_t block_size,
                        void* output) {
  for (int64_t begin = 0, block = 0; begin < n; begin += block_size, ++block) {
    const int64_t len = std::min(block_size, n - begin);
    const __m512 scale = _mm512_set1_ps(absmax[block] / 127.0f);
    for (int64_t k = 0; k < len; k += 16) {
      const __mmask16 m = Mask16(len - k);
      const __m128i bytes = _mm_maskz_loadu_epi8(m, codes + begin + k);
      const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
      Store16<D>(output, begin + k, _mm512_mul_ps(q, scale), m);
    }
  }
}

}  // namespace

void QuantizeNf4Avx512(const void* input, DType dtype, int64_t n, int64_t block_size,
                       uint8_t* codes, float* absmax) {
  return WithDType(dtype, [&](auto k) {
    return QuantizeNf4Impl<decltype(k)::value>(input, n, block_size, codes, absmax);
  });
}

void QuantizeInt8Avx512(const void* input, DType dtype, int64_t n, int64_t block_size,
                        uint8_t* codes, float* absmax) {
  return WithDType(dtype, [&](auto k) {
    return QuantizeInt8Impl<decltype(k)::value>(input, n, block_size, codes, absmax);
  });
}

void DequantizeNf4Avx512(const uint8_t* codes, const float* absmax, int64_t n, int64_t block_size,
                         void* output, DType dtype) {
  return WithDType(dtype, [&](auto k) {
    return DequantizeNf4Impl<decltype(k)::value>(codes, absmax, n, block_size, output);
  });
}

void DequantizeInt8Avx512(const uint8_t* codes, const float* absmax, int64_t n, int64_t block_size,
                          void* output, DType dtype) {
  return WithDType(dtype, [&](auto k) {
    return DequantizeInt8Impl<decltype(k)::value>(codes, absmax, n, block_size, output);
  });
}

int64_t FindNonFiniteAvx512(const void* input, DType dtype, int64_t n) {
  if (dtype == DType::kF32) {
    const float* x = static_cast<const float*>(input);
    const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
    const __m512i largest = _mm512_set1_epi32(0x7F7FFFFF);
    for (int64_t i = 0; i < n; i += 16) {
      const __m512i bits = _mm512_maskz_loadu_epi32(Mask16(n - i), x + i);
      const __mmask16 bad = _mm512_cmpgt_epi32_mask(_mm512_and_si512(bits, abs_mask), largest);
      if (bad != 0) return i + __builtin_ctz(bad);
    }
    return -1;
  }
  const uint16_t* x = static_cast<const uint16_t*>(input);
  const __m512i abs_mask = _mm512_set1_epi16(0x7FFF);
  const __m512i largest = _mm512_set1_epi16(dtype == DType::kBF16 ? 0x7F7F : 0x7BFF);
  for (int64_t i = 0; i < n; i += 32) {
    const int64_t rest = n - i;
    const __mmask32 k = rest >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << rest) - 1u);
    const __m512i bits = _mm512_maskz_loadu_epi16(k, x + i);
    const __mmask32 bad = _mm512_cmpgt_epi16_mask(_mm512_and_si512(bits, abs_mask), largest);
    if (bad != 0) return i + __builtin_ctz(bad);
  }
  return -1;
}

}  // namespace tsd::kernels::detail
