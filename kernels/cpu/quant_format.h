// The constants of tsd's quantized formats (see kernels/cpu/quant.h for the exact definitions):
// the kinds, the default block size and bitsandbytes' NF4 code values with their fp32 midpoints.
// Plain C++ without other dependencies, so that the CUDA kernels (nvcc) share the same table.
#pragma once

#include <cstdint>

namespace tsd::kernels {

// A quantized format.
enum class QuantKind : uint8_t {
  kNf4 = 0,   // 4-bit NormalFloat, bitsandbytes' layout (no double quantization)
  kInt8 = 1,  // symmetric int8, TrainStream's format
};

// Default block size of TrainStream (and bitsandbytes' default for 4-bit).
inline constexpr int64_t kDefaultQuantBlockSize = 64;

namespace detail {

// bitsandbytes' 16 NF4 code values (as the fp32 values of its decimal literals), ascending;
// index 7 is 0.0.
inline constexpr float kNf4Values[16] = {
    -1.0f,
    -0.6961928009986877f,
    -0.5250730514526367f,
    -0.39491748809814453f,
    -0.28444138169288635f,
    -0.18477343022823334f,
    -0.09105003625154495f,
    0.0f,
    0.07958029955625534f,
    0.16093020141124725f,
    0.24611230194568634f,
    0.33791524171829224f,
    0.44070982933044434f,
    0.5626170039176941f,
    0.7229568362236023f,
    1.0f,
};

// The code of 0.0.
inline constexpr uint8_t kNf4ZeroCode = 7;

// Midpoint k (0..14) between code values k and k+1, computed in fp32 as (a + b) / 2.
constexpr float Nf4Midpoint(int k) { return (kNf4Values[k] + kNf4Values[k + 1]) / 2.0f; }

// The 15 midpoints, ascending, then +Inf as a 16th entry (so tables of 16 lanes can be used).
inline constexpr float kNf4Midpoints[16] = {
    Nf4Midpoint(0),  Nf4Midpoint(1),  Nf4Midpoint(2),  Nf4Midpoint(3),
    Nf4Midpoint(4),  Nf4Midpoint(5),  Nf4Midpoint(6),  Nf4Midpoint(7),
    Nf4Midpoint(8),  Nf4Midpoint(9),  Nf4Midpoint(10), Nf4Midpoint(11),
    Nf4Midpoint(12), Nf4Midpoint(13), Nf4Midpoint(14), __builtin_inff(),
};

}  // namespace detail
}  // namespace tsd::kernels
