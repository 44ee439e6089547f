// How a job optimizer splits a bucket into pool tasks. The split is fixed: a bucket's sums of
// squares are kept per chunk and added in chunk order, so every pass that sums a bucket (a hold,
// a speculation, a commit's own pass) must split it the same way to get the same norm, bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tsd::chunks {

inline constexpr int64_t kChunk = 1 << 18;   // elements per pool task
inline constexpr int64_t kInline = 1 << 15;  // buckets this small run on the dispatcher
static_assert(kInline <= kChunk, "an inline bucket must be one chunk, as on the pool");

// The chunks a bucket of n elements splits into (chunk c: [c*kChunk, min(n, (c+1)*kChunk))).
inline constexpr size_t Count(int64_t n) {
  return n <= 0 ? 0 : static_cast<size_t>((n + kChunk - 1) / kChunk);
}

}  // namespace tsd::chunks
