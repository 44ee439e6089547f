// AVX2 AdamW kernels: 8 floats per vector, two vectors per loop iteration; the last < 8 elements
// go through the same vector code on a zero-padded copy. Compiled with -mavx2 -mfma -mf16c
// -ffp-contract=off; only called when the CPU has AVX2, FMA and F16C. Bit-identical to
// adamw_scalar.cc.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels/cpu/adamw.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/sr_hash.h"
#include "kernels/cpu/with_dtype.h"

#define TSD_INLINE inline __attribute__((always_inline))

namespace tsd::kernels::detail {
namespace {

enum class POut { kNone, kF32, kBF16, kF16 };

struct VecCoeffs {
  __m256 decay, lerp_coef, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size, grad_scale;
  __m256i key_exp_avg, key_exp_avg_sq, iota;
  bool lerp_small, scale_grad;

  explicit VecCoeffs(const AdamWCoeffs& c)
      : decay(_mm256_set1_ps(c.decay)),
        lerp_coef(_mm256_set1_ps(c.lerp_coef)),
        beta2(_mm256_set1_ps(c.beta2)),
        one_minus_beta2(_mm256_set1_ps(c.one_minus_beta2)),
        bc2_sqrt(_mm256_set1_ps(c.bc2_sqrt)),
        eps(_mm256_set1_ps(c.eps)),
        neg_step_size(_mm256_set1_ps(c.neg_step_size)),
        grad_scale(_mm256_set1_ps(c.grad_scale)),
        key_exp_avg(_mm256_set1_epi32(static_cast<int>(SrKeyFolded(c.key_exp_avg)))),
        key_exp_avg_sq(_mm256_set1_epi32(static_cast<int>(SrKeyFolded(c.key_exp_avg_sq)))),
        iota(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
        lerp_small(c.lerp_small),
        scale_grad(c.scale_grad) {}
};

struct Ptrs {
  const void* grad;
  float* master;
  void* exp_avg;
  void* exp_avg_sq;
  void* param_out;
};

TSD_INLINE __m128i LoadU16x8(const void* base, int64_t i) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
}

TSD_INLINE void StoreU16x8(void* base, int64_t i, __m128i x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i), x);
}

template <DType D>
TSD_INLINE __m256 LoadAsF32(const void* base, int64_t i) {
  if constexpr (D == DType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  } else if constexpr (D == DType::kBF16) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(LoadU16x8(base, i)), 16));
  } else {
    return _mm256_cvtph_ps(LoadU16x8(base, i));
  }
}

// Low 16 bits of each 32-bit lane (values are <= 0xFFFF, so unsigned saturation is exact).
TSD_INLINE __m128i Pack16(__m256i x) {
  return _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
}

// Low 16 bits of SrMix of sr_hash.h, lane-wise, zero-extended. `folded` is
// index ^ (index >> 16), `key` is SrKeyFolded(key) broadcast.
TSD_INLINE __m256i SrRandom8(__m256i folded, __m256i key) {
  __m256i x = _mm256_xor_si256(folded, key);
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(kSrMul1)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(kSrMul2)));
  return _mm256_srli_epi32(x, 16);
}

// Replaces NaN lanes of the 32-bit-lane bf16 result `r` by the quiet NaN of x.
TSD_INLINE __m256i FixNan(__m256 x, __m256i bits, __m256i r) {
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i q = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(r, q, nan);
}

// F32ToBf16Sr of bf16.h, lane-wise; `random16` < 2^16.
TSD_INLINE __m128i F32ToBf16Sr8(__m256 x, __m256i random16) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, random16), 16);
  return Pack16(FixNan(x, bits, r));
}

// F32ToBf16Rne of bf16.h, lane-wise.
TSD_INLINE __m128i F32ToBf16Rne8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  return Pack16(FixNan(x, bits, r));
}

// One vector of 8 elements starting at element i; idx0 is the bucket index (low 32 bits) of
// element i.
// With kNt the working parameter's stores (written only; the GPU's H2D copy reads them from memory
// next) bypass the cache: an ordinary store first reads the line it writes. Needs the output
// aligned to a vector (32 bytes of fp32, 16 of fp16/bf16).
template <DType G, DType M, POut P, bool kNt = false>
TSD_INLINE void Step8(const Ptrs& b, const VecCoeffs& c, int64_t i, uint32_t idx0) {
  __m256 g = LoadAsF32<G>(b.grad, i);
  if (c.scale_grad) g = _mm256_mul_ps(g, c.grad_scale);
  __m256 p = _mm256_loadu_ps(b.master + i);
  __m256 m = LoadAsF32<M>(b.exp_avg, i);
  __m256 v = LoadAsF32<M>(b.exp_avg_sq, i);

  p = _mm256_mul_ps(p, c.decay);
  const __m256 d = _mm256_sub_ps(g, m);
  m = _mm256_fmadd_ps(c.lerp_coef, d, c.lerp_small ? m : g);
  v = _mm256_fmadd_ps(_mm256_mul_ps(c.one_minus_beta2, g), g, _mm256_mul_ps(v, c.beta2));
  const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), c.bc2_sqrt), c.eps);
  p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(c.neg_step_size, m), denom));

  _mm256_storeu_ps(b.master + i, p);
  if constexpr (M == DType::kF32) {
    _mm256_storeu_ps(static_cast<float*>(b.exp_avg) + i, m);
    _mm256_storeu_ps(static_cast<float*>(b.exp_avg_sq) + i, v);
  } else {
    const __m256i index = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(idx0)), c.iota);
    const __m256i folded = _mm256_xor_si256(index, _mm256_srli_epi32(index, 16));
    StoreU16x8(b.exp_avg, i, F32ToBf16Sr8(m, SrRandom8(folded, c.key_exp_avg)));
    StoreU16x8(b.exp_avg_sq, i, F32ToBf16Sr8(v, SrRandom8(folded, c.key_exp_avg_sq)));
  }
  if constexpr (P == POut::kF32) {
    if constexpr (kNt) {
      _mm256_stream_ps(static_cast<float*>(b.param_out) + i, p);
    } else {
      _mm256_storeu_ps(static_cast<float*>(b.param_out) + i, p);
    }
  } else if constexpr (P == POut::kBF16 || P == POut::kF16) {
    __m128i h;
    if constexpr (P == POut::kBF16) {
      h = F32ToBf16Rne8(p);
    } else {
      h = _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    if constexpr (kNt) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(b.param_out) + i), h);
    } else {
      StoreU16x8(b.param_out, i, h);
    }
  }
}

template <DType G, DType M, POut P, bool kNt = false>
void Step(const AdamWTensors& t, const AdamWCoeffs& coeffs) {
  const VecCoeffs c(coeffs);
  const Ptrs b{t.grad, t.master, t.exp_avg, t.exp_avg_sq, t.param_out};
  const uint32_t lo = static_cast<uint32_t>(t.sr_offset);
  const int64_t n = t.n;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    Step8<G, M, P, kNt>(b, c, i, lo + static_cast<uint32_t>(i));
    Step8<G, M, P, kNt>(b, c, i + 8, lo + static_cast<uint32_t>(i + 8));
  }
  if (i + 8 <= n) {
    Step8<G, M, P, kNt>(b, c, i, lo + static_cast<uint32_t>(i));
    i += 8;
  }
  // Non-temporal stores are weakly ordered: visible before the caller publishes the range.
  if constexpr (kNt) _mm_sfence();
  if (i < n) {
    // Tail: run the same vector code on zero-padded copies of the last r < 8 elements.
    const size_t r = static_cast<size_t>(n - i);
    constexpr size_t gsz = G == DType::kF32 ? 4 : 2;
    constexpr size_t msz = M == DType::kF32 ? 4 : 2;
    constexpr size_t psz = P == POut::kF32 ? 4 : 2;
    alignas(32) unsigned char gbuf[32] = {};
    alignas(32) float pbuf[8] = {};
    alignas(32) unsigned char mbuf[32] = {};
    alignas(32) unsigned char vbuf[32] = {};
    alignas(32) unsigned char obuf[32] = {};
    std::memcpy(gbuf, static_cast<const unsigned char*>(t.grad) + i * gsz, r * gsz);
    std::memcpy(pbuf, t.master + i, r * sizeof(float));
    std::memcpy(mbuf, static_cast<const unsigned char*>(t.exp_avg) + i * msz, r * msz);
    std::memcpy(vbuf, static_cast<const unsigned char*>(t.exp_avg_sq) + i * msz, r * msz);
    const Ptrs tb{gbuf, pbuf, mbuf, vbuf, obuf};
    Step8<G, M, P>(tb, c, 0, lo + static_cast<uint32_t>(i));
    std::memcpy(t.master + i, pbuf, r * sizeof(float));
    std::memcpy(static_cast<unsigned char*>(t.exp_avg) + i * msz, mbuf, r * msz);
    std::memcpy(static_cast<unsigned char*>(t.exp_avg_sq) + i * msz, vbuf, r * msz);
    if constexpr (P != POut::kNone) {
      std::memcpy(static_cast<unsigned char*>(t.param_out) + i * psz, obuf, r * psz);
    }
  }
}

template <DType G, DType M, POut P>
void StepOut(const AdamWTensors& t, const AdamWCoeffs& c) {
  const bool aligned = reinterpret_cast<uintptr_t>(t.param_out) % (P == POut::kF32 ? 32 : 16) == 0;
  if (aligned) return Step<G, M, P, true>(t, c);
  return Step<G, M, P, false>(t, c);
}

template <DType G, DType M>
void DispatchP(const AdamWTensors& t, const AdamWCoeffs& c) {
  if (t.param_out == nullptr) return Step<G, M, POut::kNone>(t, c);
  switch (t.param_dtype) {
    case DType::kBF16:
      return StepOut<G, M, POut::kBF16>(t, c);
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
float ScalarAsF32(const void* base, int64_t i) {
  if constexpr (D == DType::kF32) {
    return static_cast<const float*>(base)[i];
  } else if constexpr (D == DType::kBF16) {
    return Bf16ToF32(static_cast<const uint16_t*>(base)[i]);
  } else {
    return F16ToF32(static_cast<const uint16_t*>(base)[i]);
  }
}

template <DType D>
void Accumulate(const void* grad, float* acc, int64_t n, bool first) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = LoadAsF32<D>(grad, i);
    _mm256_storeu_ps(acc + i, first ? g : _mm256_add_ps(_mm256_loadu_ps(acc + i), g));
  }
  for (; i < n; ++i) {
    const float g = ScalarAsF32<D>(grad, i);
    acc[i] = first ? g : acc[i] + g;
  }
}

TSD_INLINE __m256d SquareAdd(__m256 x, __m256d acc_lo, __m256d* acc_hi) {
  const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
  const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
  *acc_hi = _mm256_fmadd_pd(hi, hi, *acc_hi);  // squares of floats are exact in double
  return _mm256_fmadd_pd(lo, lo, acc_lo);
}

template <DType D>
double SumSq(const void* grad, int64_t n) {
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  __m256d a2 = _mm256_setzero_pd(), a3 = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    a0 = SquareAdd(LoadAsF32<D>(grad, i), a0, &a1);
    a2 = SquareAdd(LoadAsF32<D>(grad, i + 8), a2, &a3);
  }
  const __m256d s = _mm256_add_pd(_mm256_add_pd(a0, a1), _mm256_add_pd(a2, a3));
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, s);
  double tail = 0;
  for (; i < n; ++i) {
    const double g = ScalarAsF32<D>(grad, i);
    tail += g * g;
  }
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + tail;
}

}  // namespace

void AdamWStepAvx2(const AdamWTensors& t, const AdamWCoeffs& c) {
  return WithDType(t.grad_dtype, [&](auto k) { return DispatchM<decltype(k)::value>(t, c); });
}

void AccumulateGradAvx2(const void* grad, DType dtype, float* acc, int64_t n, bool first) {
  return WithDType(dtype,
                   [&](auto k) { return Accumulate<decltype(k)::value>(grad, acc, n, first); });
}

double SumSquaresAvx2(const void* grad, DType dtype, int64_t n) {
  return WithDType(dtype, [&](auto k) { return SumSq<decltype(k)::value>(grad, n); });
}

}  // namespace tsd::kernels::detail
