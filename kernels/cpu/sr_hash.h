// Counter-based hash that supplies the random bits for stochastic rounding of bf16 moments.
//
// The random word for element `index` of a bucket (index = sr_offset + i) and moment `stream` is
//
//   SrHash(seed, index, stream) = SrMix(SrKey(seed, index >> 32, stream), uint32_t(index))
//
// SrKey is a strong 64-bit mix (two SplitMix64 finalisers) evaluated once per call and per 2^32
// block of indices; SrMix is a 32-bit integer hash (the rounds of Wellons' "lowbias32", a
// bijection of uint32 with good avalanche) applied to index_lo ^ key, which needs only 32-bit lane
// operations (xor, shift, 32-bit multiply), so the AVX2 and AVX-512 kernels compute exactly the
// same bits per lane as this scalar code. Because the hash depends only on (seed, index, stream),
// the rounding of an element does not depend on how a bucket is split among threads or on the ISA
// used.
#pragma once

#include <cstdint>

namespace tsd::kernels {

// Stream ids: which moment the random bits are for.
inline constexpr uint32_t kSrStreamExpAvg = 0;
inline constexpr uint32_t kSrStreamExpAvgSq = 1;

// SplitMix64 finaliser (Steele, Lea, Flood 2014): a bijective 64-bit mix.
constexpr uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Per-(seed, 2^32-block, stream) key. `stream` must be < 4.
constexpr uint32_t SrKey(uint64_t seed, uint32_t index_hi, uint32_t stream) {
  const uint64_t k = SplitMix64(seed ^ SplitMix64((static_cast<uint64_t>(index_hi) << 2) | stream));
  return static_cast<uint32_t>(k ^ (k >> 32));
}

// 32-bit mix of the low index bits under `key`. The vector kernels implement this lane-wise.
// The multiply-xorshift rounds are those of lowbias32; instead of its final x ^= x >> 16 the
// result is rotated by 16, so that the low 16 bits (the ones stochastic rounding uses) are the
// well-mixed high bits of the last product, which a vector kernel gets with a single shift.
inline constexpr uint32_t kSrMul1 = 0x7FEB352Du;
inline constexpr uint32_t kSrMul2 = 0x846CA68Bu;
constexpr uint32_t SrMix(uint32_t key, uint32_t index_lo) {
  uint32_t x = index_lo ^ key;
  x ^= x >> 16;
  x *= kSrMul1;
  x ^= x >> 15;
  x *= kSrMul2;
  return (x >> 16) | (x << 16);
}

// key ^ (key >> 16): with it, (index ^ key) ^ ((index ^ key) >> 16) becomes
// index ^ (index >> 16) ^ SrKeyFolded(key), which lets vector code share index ^ (index >> 16)
// between the two moments.
constexpr uint32_t SrKeyFolded(uint32_t key) { return key ^ (key >> 16); }

// The 32-bit random word for element `index` of the bucket and moment `stream`; stochastic
// rounding uses its low 16 bits.
constexpr uint32_t SrHash(uint64_t seed, uint64_t index, uint32_t stream) {
  return SrMix(SrKey(seed, static_cast<uint32_t>(index >> 32), stream),
               static_cast<uint32_t>(index));
}

}  // namespace tsd::kernels
