#include "daemon/stores/safetensors.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace tsd::stores {
namespace {

// Reads exactly `n` bytes at `offset`; a short file is an error naming it.
absl::Status PreadAll(int fd, void* out, uint64_t n, uint64_t offset, const std::string& label) {
  auto* p = static_cast<char*>(out);
  while (n > 0) {
    const ssize_t got = pread(fd, p, n, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(label, ": reading failed: ", std::strerror(errno)));
    }
    if (got == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(label, ": the file ended early (changed while it was read?)"));
    }
    p += got;
    n -= static_cast<uint64_t>(got);
    offset += static_cast<uint64_t>(got);
  }
  return absl::OkStatus();
}

absl::Status Bad(const std::string& label, const std::string& what) {
  return absl::InvalidArgumentError(
      absl::StrCat(label, " is not a valid safetensors file: ", what));
}

}  // namespace

uint64_t SafetensorsTensor::numel() const {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

uint64_t SafetensorsDtypeBytes(const std::string& dtype) {
  static const std::pair<const char*, uint64_t> kSizes[] = {
      {"F64", 8}, {"F32", 4}, {"F16", 2},  {"BF16", 2},    {"I64", 8},
      {"U64", 8}, {"I32", 4}, {"U32", 4},  {"I16", 2},     {"U16", 2},
      {"I8", 1},  {"U8", 1},  {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}};
  for (const auto& [name, bytes] : kSizes) {
    if (dtype == name) return bytes;
  }
  return 0;
}

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(const std::string& json,
                                                         const std::string& label,
                                                         uint64_t file_bytes) {
  SafetensorsHeader h;
  h.label = label;
  h.file_bytes = file_bytes;
  h.data_offset = 8 + json.size();
  h.header_json = json;
  if (h.data_offset > file_bytes) {
    return Bad(label, absl::StrCat("its header says ", json.size(), " bytes but the file has ",
                                   file_bytes, " bytes"));
  }
  const uint64_t data_bytes = file_bytes - h.data_offset;
  nlohmann::json doc = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return Bad(label, "its header is not JSON");
  if (!doc.is_object()) return Bad(label, "its header is not a JSON object");
  for (auto it = doc.begin(); it != doc.end(); ++it) {
    const std::string& name = it.key();
    if (name == "__metadata__") continue;
    const auto bad = [&](const std::string& what) {
      return Bad(label, absl::StrCat("tensor '", name, "' ", what));
    };
    if (name.empty() || name.size() > 1024) return bad("has an empty or over-long name");
    const nlohmann::json& t = it.value();
    if (!t.is_object()) return bad("is not a JSON object");
    const auto dtype = t.find("dtype");
    const auto shape = t.find("shape");
    const auto offsets = t.find("data_offsets");
    if (dtype == t.end() || !dtype->is_string()) return bad("has no dtype string");
    if (shape == t.end() || !shape->is_array()) return bad("has no shape array");
    if (offsets == t.end() || !offsets->is_array() || offsets->size() != 2) {
      return bad("has no data_offsets [begin, end]");
    }
    SafetensorsTensor out;
    out.name = name;
    out.dtype = dtype->get<std::string>();
    const uint64_t elem = SafetensorsDtypeBytes(out.dtype);
    if (elem == 0) return bad(absl::StrCat("has an unknown dtype '", out.dtype, "'"));
    if (shape->size() > 16) return bad(absl::StrCat("has ", shape->size(), " dimensions"));
    unsigned __int128 numel = 1;
    for (const auto& d : *shape) {
      if (!d.is_number_unsigned()) return bad("has a shape entry that is not a whole number >= 0");
      out.shape.push_back(d.get<uint64_t>());
      numel *= out.shape.back();
      if (numel > std::numeric_limits<uint64_t>::max() / 8) return bad("has an absurd shape");
    }
    for (const auto& o : *offsets) {
      if (!o.is_number_unsigned()) return bad("has data_offsets that are not whole numbers >= 0");
    }
    out.begin = (*offsets)[0].get<uint64_t>();
    out.end = (*offsets)[1].get<uint64_t>();
    if (out.end < out.begin) return bad("has data_offsets whose end is before its begin");
    if (out.end > data_bytes) {
      return bad(absl::StrCat("ends at byte ", out.end, " of the data, which has only ", data_bytes,
                              " bytes (the file is truncated or the header lies)"));
    }
    const uint64_t want = static_cast<uint64_t>(numel) * elem;
    if (out.bytes() != want) {
      return bad(absl::StrCat("spans ", out.bytes(), " bytes but its shape and dtype ", out.dtype,
                              " need ", want));
    }
    h.tensors.push_back(std::move(out));
  }
  std::sort(h.tensors.begin(), h.tensors.end(),
            [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  for (size_t i = 1; i < h.tensors.size(); ++i) {
    if (h.tensors[i].begin < h.tensors[i - 1].end) {
      return Bad(label, absl::StrCat("tensors '", h.tensors[i - 1].name, "' and '",
                                     h.tensors[i].name, "' overlap"));
    }
  }
  return h;
}

absl::StatusOr<SafetensorsHeader> ReadSafetensorsHeader(int fd, const std::string& label,
                                                        uint64_t file_bytes) {
  if (file_bytes < 8) {
    return Bad(label, absl::StrCat("it has ", file_bytes,
                                   " bytes, fewer than the 8 of the "
                                   "header's length"));
  }
  unsigned char len_bytes[8];
  if (absl::Status s = PreadAll(fd, len_bytes, 8, 0, label); !s.ok()) return s;
  uint64_t len = 0;
  for (int i = 7; i >= 0; --i) len = (len << 8) | len_bytes[i];
  if (len > kMaxSafetensorsHeaderBytes) {
    return Bad(label, absl::StrCat("its header length is ", len, " bytes, more than the ",
                                   kMaxSafetensorsHeaderBytes, " accepted"));
  }
  if (len > file_bytes - 8) {
    return Bad(label, absl::StrCat("its header says ", len, " bytes but the file has ", file_bytes,
                                   " bytes"));
  }
  std::string json(len, '\0');
  if (absl::Status s = PreadAll(fd, json.data(), len, 8, label); !s.ok()) return s;
  return ParseSafetensorsHeader(json, label, file_bytes);
}

}  // namespace tsd::stores
