// A minimal safetensors checkpoint for the weight-store tests: one F32 tensor "w" of `n`
// elements, every byte `fill`. Tests that need several tensors or malformed headers write their
// own (stores_test.cc's WriteSafetensors).
#pragma once

#include <cstddef>
#include <fstream>
#include <string>

namespace tsd::testing {

// Writes the checkpoint at `path` (8-byte little-endian header length, the JSON header, the
// data) and returns `path`.
inline std::string WriteF32Checkpoint(const std::string& path, size_t n, char fill = '\x01') {
  const std::string header = "{\"w\":{\"dtype\":\"F32\",\"shape\":[" + std::to_string(n) +
                             "],\"data_offsets\":[0," + std::to_string(4 * n) + "]}}";
  std::string len(8, '\0');
  for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  std::ofstream(path, std::ios::binary) << len << header << std::string(4 * n, fill);
  return path;
}

}  // namespace tsd::testing
