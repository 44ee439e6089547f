// One element of a kernel buffer in its dtype (fp32, bf16 or fp16), read as fp32 and written from
// fp32 rounded to nearest even: the scalar kernels' loads and stores (adamw_scalar.cc) and the
// undo of a step (adamw_undo.cc). The vector paths have their own lane-wise versions.
#pragma once

#include <cstdint>

#include "kernels/cpu/adamw.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/with_dtype.h"

namespace tsd::kernels::detail {

template <DType D>
inline float LoadAsF32(const void* base, int64_t i) {
  if constexpr (D == DType::kF32) {
    return static_cast<const float*>(base)[i];
  } else if constexpr (D == DType::kBF16) {
    return Bf16ToF32(static_cast<const uint16_t*>(base)[i]);
  } else {
    return F16ToF32(static_cast<const uint16_t*>(base)[i]);
  }
}

inline float LoadAsF32(DType d, const void* base, int64_t i) {
  return WithDType(d, [&](auto k) { return LoadAsF32<decltype(k)::value>(base, i); });
}

inline void StoreRne(DType d, void* base, int64_t i, float x) {
  switch (d) {
    case DType::kBF16:
      static_cast<uint16_t*>(base)[i] = F32ToBf16Rne(x);
      break;
    case DType::kF16:
      static_cast<uint16_t*>(base)[i] = F32ToF16Rne(x);
      break;
    default:
      static_cast<float*>(base)[i] = x;
  }
}

}  // namespace tsd::kernels::detail
