// Fuzzes the safetensors header reader tsd runs on every checkpoint file a client hands it to
// build a store (daemon/stores/safetensors.cc): each input is a whole file (8-byte header length,
// the JSON header, the data) in a memfd, read with ReadSafetensorsHeader. A refusal must say why
// and name the file. An accepted header must describe tensors that lie inside the data, do not
// overlap, have unique names and span exactly their shape times their element size. And it is
// checked against a reference written the obvious way (the whole header parsed into an nlohmann
// document first, as tsd did before it read headers as a stream): what tsd accepts the reference
// accepts with the same tensors, and what the reference accepts tsd refuses only for the rules it
// adds (a name or a field given twice, a value nested deeper than 16 levels, a __metadata__ that
// is not an object of strings).
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "daemon/stores/safetensors.h"
#include "nlohmann/json.hpp"

namespace {

using Tensors = std::map<std::string, std::tuple<std::string, std::vector<uint64_t>, uint64_t,
                                                 uint64_t>>;  // dtype, shape, begin, end

// Whether any object of the document names a key twice (the reference keeps the last silently).
bool HasDuplicateKeys(const std::string& json) {
  std::vector<std::set<std::string>> open;
  bool dup = false;
  nlohmann::json::parser_callback_t cb = [&](int, nlohmann::json::parse_event_t event,
                                             nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if (event == E::object_start) open.emplace_back();
    if (event == E::object_end && !open.empty()) open.pop_back();
    if (event == E::key && !open.empty() && !open.back().insert(parsed.get<std::string>()).second) {
      dup = true;
    }
    return true;
  };
  (void)nlohmann::json::parse(json, cb, /*allow_exceptions=*/false);
  return dup;
}

// The reference: the header as a document, checked tensor by tensor.
std::optional<Tensors> Reference(const std::string& json, uint64_t data_bytes) {
  const nlohmann::json doc = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object()) return std::nullopt;
  Tensors out;
  std::vector<std::pair<uint64_t, uint64_t>> spans;
  for (auto it = doc.begin(); it != doc.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    if (it.key().empty() || it.key().size() > 1024) return std::nullopt;
    const nlohmann::json& t = it.value();
    if (!t.is_object()) return std::nullopt;
    const auto dtype = t.find("dtype"), shape = t.find("shape"), offsets = t.find("data_offsets");
    if (dtype == t.end() || !dtype->is_string()) return std::nullopt;
    if (shape == t.end() || !shape->is_array() || shape->size() > 16) return std::nullopt;
    if (offsets == t.end() || !offsets->is_array() || offsets->size() != 2) return std::nullopt;
    const uint64_t elem = tsd::stores::SafetensorsDtypeBytes(dtype->get<std::string>());
    if (elem == 0) return std::nullopt;
    unsigned __int128 numel = 1;
    std::vector<uint64_t> dims;
    for (const auto& d : *shape) {
      if (!d.is_number_unsigned()) return std::nullopt;
      dims.push_back(d.get<uint64_t>());
      numel *= dims.back();
      if (numel > std::numeric_limits<uint64_t>::max() / 8) return std::nullopt;
    }
    for (const auto& o : *offsets) {
      if (!o.is_number_unsigned()) return std::nullopt;
    }
    const uint64_t begin = (*offsets)[0].get<uint64_t>(), end = (*offsets)[1].get<uint64_t>();
    if (end < begin || end > data_bytes || end - begin != static_cast<uint64_t>(numel) * elem) {
      return std::nullopt;
    }
    out[it.key()] = {dtype->get<std::string>(), dims, begin, end};
    spans.emplace_back(begin, end);
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].first < spans[i - 1].second) return std::nullopt;
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int fd = memfd_create("fuzz-safetensors", MFD_CLOEXEC);
  if (fd < 0) return 0;
  for (size_t at = 0; at < size;) {
    const ssize_t n = write(fd, data + at, size - at);
    if (n <= 0) std::abort();
    at += static_cast<size_t>(n);
  }
  const std::string label = "/models/fuzz.safetensors";
  auto header = tsd::stores::ReadSafetensorsHeader(fd, label, size);
  close(fd);
  if (!header.ok()) {
    const std::string why(header.status().message());
    if (why.rfind(label + " is not a valid safetensors file: ", 0) != 0) std::abort();
  }
  // The header's bytes, where the length is readable and fits (else only tsd's checks apply).
  if (size < 8) return 0;
  uint64_t len = 0;
  for (int i = 7; i >= 0; --i) len = (len << 8) | data[i];
  if (len > size - 8) {
    if (header.ok()) std::abort();
    return 0;
  }
  const std::string json(reinterpret_cast<const char*>(data) + 8, len);
  const uint64_t data_bytes = size - 8 - len;
  const std::optional<Tensors> want = Reference(json, data_bytes);
  if (header.ok()) {
    if (!want.has_value() || want->size() != header->tensors.size()) std::abort();
    uint64_t last_end = 0;
    for (const tsd::stores::SafetensorsTensor& t : header->tensors) {
      const auto it = want->find(t.name);
      if (it == want->end()) std::abort();
      if (std::get<0>(it->second) != t.dtype || std::get<1>(it->second) != t.shape ||
          std::get<2>(it->second) != t.begin || std::get<3>(it->second) != t.end) {
        std::abort();
      }
      if (t.begin < last_end || t.end > data_bytes) std::abort();  // sorted, apart, inside
      if (t.bytes() != t.numel() * tsd::stores::SafetensorsDtypeBytes(t.dtype)) std::abort();
      last_end = t.end;
    }
    if (header->data_offset != 8 + len || header->header_json != json) std::abort();
  } else if (want.has_value()) {
    const std::string why(header.status().message());
    const bool stricter = why.find("twice") != std::string::npos ||
                          why.find("nested deeper than 16") != std::string::npos ||
                          why.find("__metadata__") != std::string::npos ||
                          why.find("more than 1048576 tensors") != std::string::npos;
    if (!stricter && !HasDuplicateKeys(json)) std::abort();
  }
  return 0;
}
