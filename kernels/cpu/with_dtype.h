// The one switch from a runtime DType to a kernel template over it: WithDType(d, f) calls f with
// std::integral_constant<DType, D> for d's D, so each kernel entry point reads
//   return WithDType(dtype, [&](auto g) { return SumSq<decltype(g)::value>(grad, n); });
// rather than repeating the three cases. As everywhere in the kernels, a value that is neither
// bf16 nor fp16 is read as fp32 (the daemon checks dtypes before any kernel runs).
#pragma once

#include <type_traits>

#include "kernels/cpu/adamw.h"

namespace tsd::kernels::detail {

template <typename F>
inline decltype(auto) WithDType(DType d, F&& f) {
  switch (d) {
    case DType::kBF16:
      return f(std::integral_constant<DType, DType::kBF16>{});
    case DType::kF16:
      return f(std::integral_constant<DType, DType::kF16>{});
    default:
      return f(std::integral_constant<DType, DType::kF32>{});
  }
}

}  // namespace tsd::kernels::detail
