// How the fuzz targets that take several messages cut one libFuzzer input into them: a frame is a
// 2-byte little-endian length followed by that many bytes (the last frame is cut short where the
// input ends; a trailing single byte is ignored). One definition, so that every such target reads
// its corpus the same way and a seed written for one frames the same for all.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace tsd::fuzz {

// Calls `fn(std::string_view frame)` for each frame of `data`, in order.
template <typename Fn>
void ForEachFrame(const uint8_t* data, size_t size, Fn&& fn) {
  size_t at = 0;
  while (at + 2 <= size) {
    const size_t len = std::min<size_t>(data[at] | (data[at + 1] << 8), size - at - 2);
    fn(std::string_view(reinterpret_cast<const char*>(data + at + 2), len));
    at += 2 + len;
  }
}

}  // namespace tsd::fuzz
