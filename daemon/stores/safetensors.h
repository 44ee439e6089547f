// SafetensorsHeader reads and checks the header of a safetensors checkpoint from a descriptor the
// client opened: 8 bytes of little-endian header length, then a JSON object mapping each tensor's
// name to its dtype, shape and [begin, end) offsets into the data that follows the header
// ("__metadata__" is skipped). The client is untrusted and so is its file: every length, offset,
// dtype and shape is checked (the header fits in the file, each tensor's byte span equals its
// shape times its element size and lies inside the data, no two tensors overlap, no name or field
// comes twice), and a refusal names the file and the tensor. The header is checked as nlohmann's
// SAX parser reads it, never built into a JSON document (which would cost many times the
// header's bytes, at a client's asking). Nothing here reads tensor data.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tsd::stores {

// One tensor of a safetensors file.
struct SafetensorsTensor {
  std::string name;
  std::string dtype;            // as the file names it: "F32", "BF16", "I8", ...
  std::vector<uint64_t> shape;  // empty for a scalar
  uint64_t begin = 0;           // offsets into the data section (after the header)
  uint64_t end = 0;
  uint64_t numel() const;
  uint64_t bytes() const { return end - begin; }
};

struct SafetensorsHeader {
  std::string label;                       // how errors name the file (its path, or "file 2")
  uint64_t file_bytes = 0;                 // the file's size when it was read
  uint64_t data_offset = 0;                // where the data section starts: 8 + the header's length
  std::string header_json;                 // the header's bytes, as stored
  std::vector<SafetensorsTensor> tensors;  // by begin offset
};

// Bytes of one element of `dtype`, or 0 for a dtype this reader does not know.
uint64_t SafetensorsDtypeBytes(const std::string& dtype);

// The largest header accepted (safetensors' own readers refuse more than 100 MB).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100ull << 20;

// Reads and checks the header of the safetensors file open at `fd` (pread, so the descriptor's
// offset is untouched); `label` names the file in errors. `file_bytes` is the file's size.
absl::StatusOr<SafetensorsHeader> ReadSafetensorsHeader(int fd, const std::string& label,
                                                        uint64_t file_bytes);

// Checks a header given as bytes (the JSON after the 8-byte length), for a file of `file_bytes`;
// the bytes become the result's header_json.
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(std::string json, const std::string& label,
                                                         uint64_t file_bytes);

}  // namespace tsd::stores
