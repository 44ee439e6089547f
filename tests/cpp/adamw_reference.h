// The reference the daemon's AdamW must match in the optimizer tests: torch.optim.AdamW written
// out plainly, and the helpers those tests share.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "tsd/optimizer.h"

namespace tsd::testing {

// torch.optim.AdamW (single tensor, foreach=False) for fp32 tensors on a CPU, written out plainly:
// the reference the daemon must match. Hyperparameter arithmetic in double, as Python does it; the
// per-element arithmetic as ATen's vectorised CPU kernels do it (lerp and addcmul fused with fma).
struct RefParam {
  std::vector<float> p, m, v, acc;
  int64_t step = 0;
};

inline void RefStep(RefParam& t, const std::vector<float>& g, const GroupHyper& h,
                    float grad_scale) {
  t.step += 1;
  const double bc1 = 1 - std::pow(h.beta1, static_cast<double>(t.step));
  const double bc2 = 1 - std::pow(h.beta2, static_cast<double>(t.step));
  const float step_size = static_cast<float>(h.lr / bc1);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  const float decay = static_cast<float>(1 - h.lr * h.weight_decay);
  for (size_t i = 0; i < t.p.size(); ++i) {
    const float gi = grad_scale == 1.0f ? g[i] : g[i] * grad_scale;
    t.p[i] *= decay;  // param.mul_(1 - lr*wd)
    t.m[i] = std::fma(static_cast<float>(1 - h.beta1), gi - t.m[i],
                      t.m[i]);  // exp_avg.lerp_(g, 1-beta1)
    t.v[i] =
        std::fma(static_cast<float>(1 - h.beta2) * gi, gi, t.v[i] * static_cast<float>(h.beta2));
    const float denom = std::sqrt(t.v[i]) / bc2_sqrt + static_cast<float>(h.eps);
    t.p[i] = t.p[i] + (-step_size * t.m[i]) / denom;  // addcdiv_(m, denom, -step_size)
  }
}

// Four fp32 buckets in two groups (one without weight decay, its own betas and eps): two split
// across the daemon's worker chunks, two small enough to run inline.
struct RefLayout {
  std::vector<uint64_t> sizes = {1000, 700001, 33, 300000};
  std::vector<uint32_t> group_of = {0, 0, 1, 1};
  OptimizerSpec spec;
};

inline RefLayout TwoGroupLayout(double max_grad_norm, bool accumulate) {
  RefLayout l;
  l.spec.groups = {{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1},
                   {.lr = 3e-3, .beta1 = 0.8, .beta2 = 0.95, .eps = 1e-6, .weight_decay = 0.0}};
  for (size_t b = 0; b < l.sizes.size(); ++b)
    l.spec.buckets.push_back({l.group_of[b], l.sizes[b], DType::kF32, DType::kF32});
  l.spec.max_grad_norm = max_grad_norm;
  l.spec.accumulate = accumulate;
  return l;
}

// torch.nn.utils.clip_grad_norm_ over `grads`: the global norm (in fp32) and the coefficient
// min(1, max_norm / (norm + 1e-6)) in fp32.
inline std::pair<float, float> ClipOf(const std::vector<std::vector<float>>& grads,
                                      double max_norm) {
  double total = 0;
  for (const auto& g : grads) {
    for (float x : g) total += static_cast<double>(x) * x;
  }
  const float norm = static_cast<float>(std::sqrt(total));
  float coef = static_cast<float>(max_norm) / (norm + 1e-6f);
  if (coef > 1.0f) coef = 1.0f;
  return {norm, coef};
}

inline std::vector<float> RandomVec(size_t n, std::mt19937& rng, float scale) {
  std::normal_distribution<float> d(0, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// One reference parameter per size: weights drawn from N(0, 0.5), moments zero.
inline std::vector<RefParam> RandomRef(const std::vector<uint64_t>& sizes, std::mt19937& rng) {
  std::vector<RefParam> ref(sizes.size());
  for (size_t b = 0; b < sizes.size(); ++b) {
    ref[b].p = RandomVec(sizes[b], rng, 0.5f);
    ref[b].m.assign(sizes[b], 0);
    ref[b].v.assign(sizes[b], 0);
  }
  return ref;
}

inline double MaxRelDiff(const float* a, const std::vector<float>& b) {
  double worst = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    const double diff = std::fabs(static_cast<double>(a[i]) - b[i]);
    worst = std::max(worst, diff / std::max(1e-3, std::fabs(static_cast<double>(b[i]))));
  }
  return worst;
}

inline double MaxAbsDiff(const float* a, const std::vector<float>& b) {
  double worst = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    worst = std::max(worst, std::fabs(static_cast<double>(a[i]) - b[i]));
  }
  return worst;
}

}  // namespace tsd::testing
