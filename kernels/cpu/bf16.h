// Scalar conversions between fp32 and the 16-bit float formats used by the AdamW kernels.
//
// These are the reference semantics: every vector path in kernels/cpu produces exactly the bits
// these functions produce (the tests check that), so they are also what a caller can use to
// reproduce a kernel's output element by element.
//
//  * bf16 -> fp32 and fp16 -> fp32 are exact.
//  * fp32 -> bf16 / fp16 with round-to-nearest-even ("RNE"); overflow goes to +-Inf, subnormals
//    are kept (never flushed to zero), NaN stays NaN (made quiet, sign and top payload bits kept).
//  * fp32 -> bf16 with stochastic rounding ("SR"): the low 16 bits of a random 32-bit word are
//    added to the fp32 bit pattern, which is then truncated. A value strictly between two bf16
//    neighbours lo < x < hi becomes hi with probability (x - lo) / (hi - lo), so the expectation of
//    the result is x (unbiased). +-Inf stays +-Inf and NaN stays NaN.
#pragma once

#include <bit>
#include <cstdint>

namespace tsd::kernels {

// bf16 bits -> fp32 (exact).
constexpr float Bf16ToF32(uint16_t h) {
  return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
}

// True when the fp32 bit pattern `bits` is a NaN.
constexpr bool F32BitsIsNan(uint32_t bits) { return (bits & 0x7FFFFFFFu) > 0x7F800000u; }

// fp32 -> bf16 bits, round-to-nearest-even. Same result as the AVX512_BF16 instruction
// VCVTNEPS2BF16 except that subnormal inputs are rounded instead of flushed to zero.
constexpr uint16_t F32ToBf16Rne(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if (F32BitsIsNan(x)) return static_cast<uint16_t>((x >> 16) | 0x0040u);  // quiet NaN
  // Cannot wrap: the largest non-NaN pattern is 0xFF800000 (-Inf).
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

// fp32 -> bf16 bits with stochastic rounding. Only the low 16 bits of `random` are used.
// +-Inf is unchanged (adding < 2^16 to 0x7F800000 / 0xFF800000 truncates back to it); a finite
// value above the largest bf16 can round to +-Inf, with the probability SR gives it.
constexpr uint16_t F32ToBf16Sr(float f, uint32_t random) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if (F32BitsIsNan(x)) return static_cast<uint16_t>((x >> 16) | 0x0040u);  // quiet NaN
  return static_cast<uint16_t>((x + (random & 0xFFFFu)) >> 16);
}

// fp16 (IEEE binary16) bits -> fp32 (exact). NaN is made quiet with its payload kept, as the F16C
// instruction VCVTPH2PS does.
constexpr float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (exp == 0x1F) {
    return std::bit_cast<float>(sign | 0x7F800000u | (man << 13) | (man != 0 ? 0x00400000u : 0u));
  }
  if (exp == 0) {
    // Zero or subnormal: man * 2^-24, exact in fp32.
    const float mag = static_cast<float>(man) * 0x1p-24f;
    return std::bit_cast<float>(sign | std::bit_cast<uint32_t>(mag));
  }
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (man << 13));
}

// fp32 -> fp16 bits, round-to-nearest-even, the result F16C's VCVTPS2PH gives with
// _MM_FROUND_TO_NEAREST_INT: |x| >= 65520 gives +-Inf, subnormal halves are produced (not
// flushed), NaN gives a quiet NaN keeping the sign and the top 10 payload bits.
constexpr uint16_t F32ToF16Rne(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((ax >> 13) & 0x3FFu));
  if (ax >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 (or Inf)
  if (ax >= 0x38800000u) {                                              // >= 2^-14: normal half
    const uint32_t r = ax - 0x38000000u;                                // rebias exponent 127 -> 15
    return static_cast<uint16_t>(sign | ((r + 0x0FFFu + ((r >> 13) & 1u)) >> 13));
  }
  if (ax < 0x33000000u) return static_cast<uint16_t>(sign);  // < 2^-25 (2^-25 itself ties to 0)
  // Subnormal half: result = round(|x| / 2^-24) = round(man * 2^(e - 126)), shift in [14, 24].
  const uint32_t man = (ax & 0x007FFFFFu) | 0x00800000u;
  const uint32_t shift = 126u - (ax >> 23);
  const uint32_t q = man >> shift;
  const uint32_t rem = man & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  const uint32_t rounded = q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
  return static_cast<uint16_t>(sign | rounded);
}

}  // namespace tsd::kernels
