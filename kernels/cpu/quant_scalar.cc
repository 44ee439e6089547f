// Scalar reference of the quantize/dequantize kernels (kernels/cpu/quant.h): one element at a
// time, written as literally as the format's definition reads. The AVX2 and AVX-512 paths must
// produce exactly these bits. Compiled for baseline x86-64 with -ffp-contract=off.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/bf16.h"
#include "kernels/cpu/quant.h"

namespace tsd::kernels::detail {
namespace {

float LoadElement(const void* base, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kBF16: {
      uint16_t h;
      std::memcpy(&h, static_cast<const uint16_t*>(base) + i, 2);
      return Bf16ToF32(h);
    }
    case DType::kF16: {
      uint16_t h;
      std::memcpy(&h, static_cast<const uint16_t*>(base) + i, 2);
      return F16ToF32(h);
    }
    default:
      return static_cast<const float*>(base)[i];
  }
}

void StoreElement(void* base, DType dtype, int64_t i, float v) {
  switch (dtype) {
    case DType::kBF16: {
      const uint16_t h = F32ToBf16Rne(v);
      std::memcpy(static_cast<uint16_t*>(base) + i, &h, 2);
      break;
    }
    case DType::kF16: {
      const uint16_t h = F32ToF16Rne(v);
      std::memcpy(static_cast<uint16_t*>(base) + i, &h, 2);
      break;
    }
    default:
      static_cast<float*>(base)[i] = v;
  }
}

// max |x| over elements [begin, end) of the input.
float BlockAbsmax(const void* input, DType dtype, int64_t begin, int64_t end) {
  float m = 0.0f;
  for (int64_t i = begin; i < end; ++i) m = std::max(m, std::fabs(LoadElement(input, dtype, i)));
  return m;
}

// The NF4 code of x in a block with absmax `absmax` (> 0): the nearest code value to x / absmax,
// decided by the fp32 midpoints; a value equal to a midpoint takes the lower code.
uint8_t Nf4Code(float x, float absmax) {
  const float reciprocal = 1.0f / absmax;
  const float s = x == 0.0f ? 0.0f : x * reciprocal;  // 0 * Inf would be NaN
  uint8_t code = 0;
  while (code < 15 && s > Nf4Midpoint(code)) ++code;
  return code;
}

// Rounds s (|s| <= 127) to the nearest integer, ties to even.
float RoundHalfEven(float s) {
  const float f = std::floor(s);
  const float frac = s - f;  // exact for |s| < 2^23
  if (frac > 0.5f) return f + 1.0f;
  if (frac < 0.5f) return f;
  return std::fmod(f, 2.0f) == 0.0f ? f : f + 1.0f;
}

int8_t Int8Code(float x, float absmax) {
  const float scale = 127.0f / absmax;
  float s = x == 0.0f ? 0.0f : x * scale;
  s = std::clamp(s, -127.0f, 127.0f);
  return static_cast<int8_t>(RoundHalfEven(s));
}

}  // namespace

void QuantizeNf4Scalar(const void* input, DType dtype, int64_t n, int64_t block_size,
                       uint8_t* codes, float* absmax) {
  for (int64_t begin = 0, block = 0; begin < n; begin += block_size, ++block) {
    const int64_t end = std::min(n, begin + block_size);
    const float amax = BlockAbsmax(input, dtype, begin, end);
    absmax[block] = amax;
    for (int64_t i = begin; i < end; i += 2) {
      const uint8_t hi = amax == 0.0f ? kNf4ZeroCode : Nf4Code(LoadElement(input, dtype, i), amax);
      uint8_t lo = kNf4ZeroCode;  // padding of an odd count
      if (i + 1 < end) {
        lo = amax == 0.0f ? kNf4ZeroCode : Nf4Code(LoadElement(input, dtype, i + 1), amax);
      }
      codes[i / 2] = static_cast<uint8_t>((hi << 4) | lo);
    }
  }
}

void QuantizeInt8Scalar(const void* input, DType dtype, int64_t n, int64_t block_size,
                        uint8_t* codes, float* absmax) {
  for (int64_t begin = 0, block = 0; begin < n; begin += block_size, ++block) {
    const int64_t end = std::min(n, begin + block_size);
    const float amax = BlockAbsmax(input, dtype, begin, end);
    absmax[block] = amax;
    for (int64_t i = begin; i < end; ++i) {
      const int8_t q = amax == 0.0f ? int8_t{0} : Int8Code(LoadElement(input, dtype, i), amax);
      codes[i] = static_cast<uint8_t>(q);
    }
  }
}

void DequantizeNf4Scalar(const uint8_t* codes, const float* absmax, int64_t n, int64_t block_size,
                         void* output, DType dtype) {
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t byte = codes[i / 2];
    const uint8_t code = (i % 2 == 0) ? static_cast<uint8_t>(byte >> 4) : (byte & 0x0F);
    StoreElement(output, dtype, i, kNf4Values[code] * absmax[i / block_size]);
  }
}

void DequantizeInt8Scalar(const uint8_t* codes, const float* absmax, int64_t n, int64_t block_size,
                          void* output, DType dtype) {
  for (int64_t i = 0; i < n; ++i) {
    const float q = static_cast<float>(static_cast<int8_t>(codes[i]));
    const float scale = absmax[i / block_size] / 127.0f;
    StoreElement(output, dtype, i, q * scale);
  }
}

int64_t FindNonFiniteScalar(const void* input, DType dtype, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(LoadElement(input, dtype, i))) return i;
  }
  return -1;
}

}  // namespace tsd::kernels::detail
