// Portable (baseline x86-64) AdamW kernels. This file is the reference the vector paths must match
// bit for bit. Compiled with -ffp-contract=off: the only fused multiply-adds are the explicit
// std::fma calls, which are exactly the ones PyTorch's vectorised kernels perform.
#include <cmath>
#include <cstdint>

#include "kernels/cpu/adamw.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/element.h"
#include "kernels/cpu/sr_hash.h"
#include "kernels/cpu/with_dtype.h"

namespace tsd::kernels::detail {
namespace {

// 0: no param output; else the param dtype.
enum class POut { kNone, kF32, kBF16, kF16 };

template <DType G, DType M, POut P>
void Step(const AdamWTensors& t, const AdamWCoeffs& c) {
  const float* __restrict grad_f = static_cast<const float*>(t.grad);
  const uint16_t* __restrict grad_h = static_cast<const uint16_t*>(t.grad);
  float* __restrict master = t.master;
  const uint32_t index_lo = static_cast<uint32_t>(t.sr_offset);
  for (int64_t i = 0; i < t.n; ++i) {
    float g;
    if constexpr (G == DType::kF32) {
      g = grad_f[i];
    } else if constexpr (G == DType::kBF16) {
      g = Bf16ToF32(grad_h[i]);
    } else {
      g = F16ToF32(grad_h[i]);
    }
    if (c.scale_grad) g = g * c.grad_scale;
    float p = master[i];
    float m = LoadAsF32<M>(t.exp_avg, i);
    float v = LoadAsF32<M>(t.exp_avg_sq, i);

    p = p * c.decay;
    const float d = g - m;
    m = c.lerp_small ? std::fma(c.lerp_coef, d, m) : std::fma(c.lerp_coef, d, g);
    v = std::fma(c.one_minus_beta2 * g, g, v * c.beta2);
    const float denom = std::sqrt(v) / c.bc2_sqrt + c.eps;
    p = p + (c.neg_step_size * m) / denom;

    master[i] = p;
    if constexpr (M == DType::kF32) {
      static_cast<float*>(t.exp_avg)[i] = m;
      static_cast<float*>(t.exp_avg_sq)[i] = v;
    } else {
      const uint32_t idx = index_lo + static_cast<uint32_t>(i);
      static_cast<uint16_t*>(t.exp_avg)[i] = F32ToBf16Sr(m, SrMix(c.key_exp_avg, idx));
      static_cast<uint16_t*>(t.exp_avg_sq)[i] = F32ToBf16Sr(v, SrMix(c.key_exp_avg_sq, idx));
    }
    if constexpr (P == POut::kF32) {
      static_cast<float*>(t.param_out)[i] = p;
    } else if constexpr (P == POut::kBF16) {
      static_cast<uint16_t*>(t.param_out)[i] = F32ToBf16Rne(p);
    } else if constexpr (P == POut::kF16) {
      static_cast<uint16_t*>(t.param_out)[i] = F32ToF16Rne(p);
    }
  }
}

template <DType G, DType M>
void DispatchP(const AdamWTensors& t, const AdamWCoeffs& c) {
  if (t.param_out == nullptr) return Step<G, M, POut::kNone>(t, c);
  switch (t.param_dtype) {
    case DType::kBF16:
      return Step<G, M, POut::kBF16>(t, c);
    case DType::kF16:
      return Step<G, M, POut::kF16>(t, c);
    default:
      return Step<G, M, POut::kF32>(t, c);
  }
}

template <DType G>
void DispatchM(const AdamWTensors& t, const AdamWCoeffs& c) {
  if (t.moment_dtype == DType::kBF16) return DispatchP<G, DType::kBF16>(t, c);
  return DispatchP<G, DType::kF32>(t, c);
}

}  // namespace

void AdamWStepScalar(const AdamWTensors& t, const AdamWCoeffs& c) {
  return WithDType(t.grad_dtype, [&](auto k) { return DispatchM<decltype(k)::value>(t, c); });
}

void AccumulateGradScalar(const void* grad, DType dtype, float* acc, int64_t n, bool first) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = LoadAsF32(dtype, grad, i);
    acc[i] = first ? g : acc[i] + g;
  }
}

double SumSquaresScalar(const void* grad, DType dtype, int64_t n) {
  // Four partial sums: a little faster, and no worse than one running sum.
  double s[4] = {0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int k = 0; k < 4; ++k) {
      const double g = LoadAsF32(dtype, grad, i + k);
      s[k] += g * g;
    }
  }
  for (; i < n; ++i) {
    const double g = LoadAsF32(dtype, grad, i);
    s[0] += g * g;
  }
  return (s[0] + s[1]) + (s[2] + s[3]);
}

}  // namespace tsd::kernels::detail
