// AdamWUndo: the inverse of one AdamWStep, for the daemon's speculative clipping (an update made
// before the step's gradient norm was known, undone when clipping turns out to bite or the
// hyperparameters changed before the commit). Rare by construction, so one portable loop.
//
// Per element, from the stored (p', m', v') and the gradient the step used, in double:
//   the step term u is recomputed in fp32 exactly as the step computed it from m' and v';
//   p = (p' - u) / float(1 - lr*wd)
//   m = (m' - w*g) / (1 - w)          with w = float(1 - beta1)   (0 when w == 1)
//   v = max(0, (v' - float(1-beta2)*g*g) / float(beta2))           (0 when beta2 == 0)
// and stores them rounded to nearest (moments in their dtype), the param copy converted from p.
// This is the exact inverse up to rounding: the stored values were rounded once, so the
// recovered ones are within a few ulps of the originals (fp32 moments); bf16 moments were
// stochastically rounded to 8 bits, so theirs are within that rounding.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cpu/adamw.h"
#include "kernels/cpu/element.h"

namespace tsd::kernels {

void AdamWUndo(const AdamWTensors& t, const AdamWHyper& h) {
  if (t.n <= 0) return;
  const detail::AdamWCoeffs c = detail::MakeAdamWCoeffs(h);
  const double w = c.lerp_weight, keep = 1.0 - w;
  const double omb2 = c.one_minus_beta2, b2 = c.beta2;
  for (int64_t i = 0; i < t.n; ++i) {
    float g = detail::LoadAsF32(t.grad_dtype, t.grad, i);
    if (c.scale_grad) g = g * c.grad_scale;
    const float m1 = detail::LoadAsF32(t.moment_dtype, t.exp_avg, i);
    const float v1 = detail::LoadAsF32(t.moment_dtype, t.exp_avg_sq, i);
    const float denom = std::sqrt(v1) / c.bc2_sqrt + c.eps;
    const float u = (c.neg_step_size * m1) / denom;
    const double p = (static_cast<double>(t.master[i]) - u) / c.decay;
    const double m = keep != 0 ? (m1 - w * g) / keep : 0.0;
    const double v = b2 != 0 ? std::max(0.0, (v1 - omb2 * g * static_cast<double>(g)) / b2) : 0.0;
    t.master[i] = static_cast<float>(p);
    detail::StoreRne(t.moment_dtype, t.exp_avg, i, static_cast<float>(m));
    detail::StoreRne(t.moment_dtype, t.exp_avg_sq, i, static_cast<float>(v));
    if (t.param_out != nullptr) detail::StoreRne(t.param_dtype, t.param_out, i, t.master[i]);
  }
}

}  // namespace tsd::kernels
