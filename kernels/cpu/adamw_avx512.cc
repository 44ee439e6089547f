// AVX-512 AdamW kernels: 16 floats per vector, two vectors per loop iteration, masked loads and
// stores for the tail. Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -mavx2 -mfma
// -mf16c -ffp-contract=off; only called when the CPU has AVX-512 F/BW/VL (AVX512_BF16 is used
// only when detail::Avx512UseBf16Insn() says the CPU has it). Bit-identical to adamw_scalar.cc.

// GCC 12 reports false "-Wmaybe-uninitialized" inside AVX-512 intrinsics that use
// _mm512_undefined_* (GCC bug 105593); silence it for this file only.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <immintrin.h>

#include <bit>
#include <cstdint>

#include "kernels/cpu/adamw.h"
#include "kernels/cpu/sr_hash.h"
#include "kernels/cpu/with_dtype.h"

#define TSD_INLINE inline __attribute__((always_inline))

namespace tsd::kernels::detail {
namespace {

enum class POut { kNone, kF32, kBF16, kF16 };

struct VecCoeffs {
  __m512 decay, lerp_coef, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size, grad_scale;
  __m512i key_exp_avg, key_exp_avg_sq, iota;
  bool lerp_small, scale_grad;

  explicit VecCoeffs(const AdamWCoeffs& c)
      : decay(_mm512_set1_ps(c.decay)),
        lerp_coef(_mm512_set1_ps(c.lerp_coef)),
        beta2(_mm512_set1_ps(c.beta2)),
        one_minus_beta2(_mm512_set1_ps(c.one_minus_beta2)),
        bc2_sqrt(_mm512_set1_ps(c.bc2_sqrt)),
        eps(_mm512_set1_ps(c.eps)),
        neg_step_size(_mm512_set1_ps(c.neg_step_size)),
        grad_scale(_mm512_set1_ps(c.grad_scale)),
        key_exp_avg(_mm512_set1_epi32(static_cast<int>(SrKeyFolded(c.key_exp_avg)))),
        key_exp_avg_sq(_mm512_set1_epi32(static_cast<int>(SrKeyFolded(c.key_exp_avg_sq)))),
        iota(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)),
        lerp_small(c.lerp_small),
        scale_grad(c.scale_grad) {}
};

// Buffers of one range, as typed pointers.
struct Ptrs {
  const void* grad;
  float* master;
  void* exp_avg;
  void* exp_avg_sq;
  void* param_out;
};

template <bool kMasked>
TSD_INLINE __m512 LoadF32(const float* p, __mmask16 k) {
  if constexpr (kMasked) {
    return _mm512_maskz_loadu_ps(k, p);
  } else {
    return _mm512_loadu_ps(p);
  }
}

template <bool kMasked>
TSD_INLINE __m256i LoadU16(const uint16_t* p, __mmask16 k) {
  if constexpr (kMasked) {
    return _mm256_maskz_loadu_epi16(k, p);
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
}

template <bool kMasked>
TSD_INLINE void StoreF32(float* p, __m512 x, __mmask16 k) {
  if constexpr (kMasked) {
    _mm512_mask_storeu_ps(p, k, x);
  } else {
    _mm512_storeu_ps(p, x);
  }
}

template <bool kMasked>
TSD_INLINE void StoreU16(void* base, int64_t i, __m256i x, __mmask16 k) {
  uint16_t* p = static_cast<uint16_t*>(base) + i;
  if constexpr (kMasked) {
    _mm256_mask_storeu_epi16(p, k, x);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x);
  }
}

// The working parameter's stores (param_out): written only, never read by the kernel, so with
// kNt (an aligned buffer) they bypass the cache (non-temporal): an ordinary store first reads the
// line it writes (2 or 4 bytes of host traffic per parameter more); the GPU's H2D copy reads it
// from memory next. Masked (tail) stores stay ordinary.
template <bool kMasked, bool kNt>
TSD_INLINE void StoreOutF32(float* p, __m512 x, __mmask16 k) {
  if constexpr (kNt && !kMasked) {
    _mm512_stream_ps(p, x);
  } else {
    StoreF32<kMasked>(p, x, k);
  }
}

template <bool kMasked, bool kNt>
TSD_INLINE void StoreOutU16(void* base, int64_t i, __m256i x, __mmask16 k) {
  if constexpr (kNt && !kMasked) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(base) + i), x);
  } else {
    StoreU16<kMasked>(base, i, x, k);
  }
}

template <DType D, bool kMasked>
TSD_INLINE __m512 LoadAsF32(const void* base, int64_t i, __mmask16 k) {
  if constexpr (D == DType::kF32) {
    return LoadF32<kMasked>(static_cast<const float*>(base) + i, k);
  } else {
    const __m256i h = LoadU16<kMasked>(static_cast<const uint16_t*>(base) + i, k);
    if constexpr (D == DType::kBF16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

// Low 16 bits of SrMix of sr_hash.h, lane-wise, zero-extended. `folded` is
// index ^ (index >> 16), `key` is SrKeyFolded(key) broadcast.
TSD_INLINE __m512i SrRandom16(__m512i folded, __m512i key) {
  __m512i x = _mm512_xor_si512(folded, key);
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(kSrMul1)));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(kSrMul2)));
  return _mm512_srli_epi32(x, 16);
}

// Quiet-NaN bf16 of each lane (used where the lane is NaN), in 32-bit lanes.
TSD_INLINE __m512i Bf16QuietNan(__m512i bits) {
  return _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
}

// F32ToBf16Sr of bf16.h, lane-wise; `random16` < 2^16.
TSD_INLINE __m256i F32ToBf16Sr16(__m512 x, __m512i random16) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, random16), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, Bf16QuietNan(bits)));
}

// F32ToBf16Rne of bf16.h with integer operations.
TSD_INLINE __m256i F32ToBf16RneInt16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, Bf16QuietNan(bits)));
}

// F32ToBf16Rne of bf16.h. VCVTNEPS2BF16 rounds to nearest even and quiets NaN exactly like it,
// but treats subnormal inputs as zero, so subnormal lanes (rare) are redone with integer code.
template <bool kBf16Insn>
TSD_INLINE __m256i F32ToBf16Rne16(__m512 x) {
  if constexpr (kBf16Insn) {
    __m256i r = std::bit_cast<__m256i>(_mm512_cvtneps_pbh(x));
    const __m512i bits = _mm512_castps_si512(x);
    const __mmask16 subnormal = _mm512_testn_epi32_mask(bits, _mm512_set1_epi32(0x7F800000)) &
                                _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0x007FFFFF));
    if (__builtin_expect(subnormal != 0, 0)) {
      r = _mm256_mask_blend_epi16(subnormal, r, F32ToBf16RneInt16(x));
    }
    return r;
  } else {
    return F32ToBf16RneInt16(x);
  }
}

// One vector of 16 elements starting at element i; idx0 is the bucket index (low 32 bits) of
// element i.
template <DType G, DType M, POut P, bool kBf16Insn, bool kNt, bool kMasked>
TSD_INLINE void Step16(const Ptrs& b, const VecCoeffs& c, int64_t i, uint32_t idx0, __mmask16 k) {
  __m512 g = LoadAsF32<G, kMasked>(b.grad, i, k);
  if (c.scale_grad) g = _mm512_mul_ps(g, c.grad_scale);
  __m512 p = LoadF32<kMasked>(b.master + i, k);
  __m512 m = LoadAsF32<M, kMasked>(b.exp_avg, i, k);
  __m512 v = LoadAsF32<M, kMasked>(b.exp_avg_sq, i, k);

  p = _mm512_mul_ps(p, c.decay);
  const __m512 d = _mm512_sub_ps(g, m);
  m = _mm512_fmadd_ps(c.lerp_coef, d, c.lerp_small ? m : g);
  v = _mm512_fmadd_ps(_mm512_mul_ps(c.one_minus_beta2, g), g, _mm512_mul_ps(v, c.beta2));
  const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), c.bc2_sqrt), c.eps);
  p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(c.neg_step_size, m), denom));

  StoreF32<kMasked>(b.master + i, p, k);
  if constexpr (M == DType::kF32) {
    StoreF32<kMasked>(static_cast<float*>(b.exp_avg) + i, m, k);
    StoreF32<kMasked>(static_cast<float*>(b.exp_avg_sq) + i, v, k);
  } else {
    const __m512i index = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(idx0)), c.iota);
    const __m512i folded = _mm512_xor_si512(index, _mm512_srli_epi32(index, 16));
    StoreU16<kMasked>(b.exp_avg, i, F32ToBf16Sr16(m, SrRandom16(folded, c.key_exp_avg)), k);
    StoreU16<kMasked>(b.exp_avg_sq, i, F32ToBf16Sr16(v, SrRandom16(folded, c.key_exp_avg_sq)), k);
  }
  if constexpr (P == POut::kF32) {
    StoreOutF32<kMasked, kNt>(static_cast<float*>(b.param_out) + i, p, k);
  } else if constexpr (P == POut::kBF16) {
    StoreOutU16<kMasked, kNt>(b.param_out, i, F32ToBf16Rne16<kBf16Insn>(p), k);
  } else if constexpr (P == POut::kF16) {
    StoreOutU16<kMasked, kNt>(b.param_out, i,
                              _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), k);
  }
}

template <DType G, DType M, POut P, bool kBf16Insn = false, bool kNt = false>
void Step(const AdamWTensors& t, const AdamWCoeffs& coeffs) {
  const VecCoeffs c(coeffs);
  const Ptrs b{t.grad, t.master, t.exp_avg, t.exp_avg_sq, t.param_out};
  const uint32_t lo = static_cast<uint32_t>(t.sr_offset);
  const int64_t n = t.n;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    Step16<G, M, P, kBf16Insn, kNt, false>(b, c, i, lo + static_cast<uint32_t>(i), 0);
    Step16<G, M, P, kBf16Insn, kNt, false>(b, c, i + 16, lo + static_cast<uint32_t>(i + 16), 0);
  }
  if (i + 16 <= n) {
    Step16<G, M, P, kBf16Insn, kNt, false>(b, c, i, lo + static_cast<uint32_t>(i), 0);
    i += 16;
  }
  if (i < n) {
    const __mmask16 k = _cvtu32_mask16((1u << (n - i)) - 1u);
    Step16<G, M, P, kBf16Insn, kNt, true>(b, c, i, lo + static_cast<uint32_t>(i), k);
  }
  // Non-temporal stores are weakly ordered: they must be visible before whoever called this
  // publishes the range as done (a release store, which does not order them).
  if constexpr (kNt) _mm_sfence();
}

// A vector's param_out store is aligned (16 elements: 64 bytes of fp32, 32 of fp16/bf16) when
// the range's first element is.
template <POut P>
bool OutAligned(const void* param_out) {
  return reinterpret_cast<uintptr_t>(param_out) % (P == POut::kF32 ? 64 : 32) == 0;
}

template <DType G, DType M, POut P, bool kBf16Insn = false>
void StepOut(const AdamWTensors& t, const AdamWCoeffs& c) {
  if (OutAligned<P>(t.param_out)) return Step<G, M, P, kBf16Insn, true>(t, c);
  return Step<G, M, P, kBf16Insn, false>(t, c);
}

template <DType G, DType M>
void DispatchP(const AdamWTensors& t, const AdamWCoeffs& c) {
  if (t.param_out == nullptr) return Step<G, M, POut::kNone>(t, c);
  switch (t.param_dtype) {
    case DType::kBF16:
      if (Avx512UseBf16Insn()) return StepOut<G, M, POut::kBF16, true>(t, c);
      return StepOut<G, M, POut::kBF16, false>(t, c);
    case DType::kF16:
      return StepOut<G, M, POut::kF16>(t, c);
    default:
      return StepOut<G, M, POut::kF32>(t, c);
  }
}

template <DType G>
void DispatchM(const AdamWTensors& t, const AdamWCoeffs& c) {
  if (t.moment_dtype == DType::kBF16) return DispatchP<G, DType::kBF16>(t, c);
  return DispatchP<G, DType::kF32>(t, c);
}

template <DType D>
void Accumulate(const void* grad, float* acc, int64_t n, bool first) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 g = LoadAsF32<D, false>(grad, i, 0);
    _mm512_storeu_ps(acc + i, first ? g : _mm512_add_ps(_mm512_loadu_ps(acc + i), g));
  }
  if (i < n) {
    const __mmask16 k = _cvtu32_mask16((1u << (n - i)) - 1u);
    const __m512 g = LoadAsF32<D, true>(grad, i, k);
    _mm512_mask_storeu_ps(acc + i, k,
                          first ? g : _mm512_add_ps(_mm512_maskz_loadu_ps(k, acc + i), g));
  }
}

TSD_INLINE __m512d SquareAdd(__m512 x, __m512d acc_lo, __m512d* acc_hi) {
  const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
  const __m512d hi =
      _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  *acc_hi = _mm512_fmadd_pd(hi, hi, *acc_hi);  // squares of floats are exact in double
  return _mm512_fmadd_pd(lo, lo, acc_lo);
}

template <DType D>
double SumSq(const void* grad, int64_t n) {
  __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
  __m512d a2 = _mm512_setzero_pd(), a3 = _mm512_setzero_pd();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = SquareAdd(LoadAsF32<D, false>(grad, i, 0), a0, &a1);
    a2 = SquareAdd(LoadAsF32<D, false>(grad, i + 16, 0), a2, &a3);
  }
  for (; i < n; i += 16) {
    const int64_t r = n - i;
    const __mmask16 k = _cvtu32_mask16(r >= 16 ? 0xFFFFu : (1u << r) - 1u);
    a0 = SquareAdd(LoadAsF32<D, true>(grad, i, k), a0, &a1);
  }
  return _mm512_reduce_add_pd(_mm512_add_pd(_mm512_add_pd(a0, a1), _mm512_add_pd(a2, a3)));
}

}  // namespace

void AdamWStepAvx512(const AdamWTensors& t, const AdamWCoeffs& c) {
  return WithDType(t.grad_dtype, [&](auto k) { return DispatchM<decltype(k)::value>(t, c); });
}

void AccumulateGradAvx512(const void* grad, DType dtype, float* acc, int64_t n, bool first) {
  return WithDType(dtype,
                   [&](auto k) { return Accumulate<decltype(k)::value>(grad, acc, n, first); });
}

double SumSquaresAvx512(const void* grad, DType dtype, int64_t n) {
  return WithDType(dtype, [&](auto k) { return SumSq<decltype(k)::value>(grad, n); });
}

}  // namespace tsd::kernels::detail
