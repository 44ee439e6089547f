// The optimizer state file's names: one table for the daemon (which writes and reads the file)
// and the Python client (which reads and writes it for state_dict()/load_state_dict()).
//
// The file is safetensors with metadata {"format": kStateFormat, ...}. Per bucket b it holds the
// entries "b<b>.<part>" for each part of kStateParts, in that order: master (F32), exp_avg and
// exp_avg_sq (the registered moment dtype), step (I64, one element).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace tsd::wire {

inline constexpr char kStateFormat[] = "tsd.optimizer.v1";

enum class StatePart : uint8_t { kMaster = 0, kExpAvg = 1, kExpAvgSq = 2, kStep = 3 };
inline constexpr std::array<std::string_view, 4> kStateParts = {"master", "exp_avg", "exp_avg_sq",
                                                                "step"};

// "b<bucket>.<part>": the name of one bucket's entry.
inline std::string StateEntryName(uint64_t bucket, StatePart part) {
  return "b" + std::to_string(bucket) + "." + std::string(kStateParts[static_cast<size_t>(part)]);
}

}  // namespace tsd::wire
