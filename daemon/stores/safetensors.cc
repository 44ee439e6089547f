#include "daemon/stores/safetensors.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <string_view>
#include <utility>
#include <vector>

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

// HeaderReader checks a safetensors header as nlohmann's SAX parser reads it, building only the
// tensors' entries: never a JSON document of the whole header. A document would cost the daemon
// many times the header's bytes (a 40 MB header of nested arrays took 1.5 GB), which a client
// could ask for with every store request; here memory is the tensors' entries, and a refusal
// stops the parse at once. The shape it accepts is safetensors': an object of tensors, each an
// object with "dtype" (a string), "shape" (whole numbers) and "data_offsets" ([begin, end] into
// the data), other keys ignored (to a bounded depth), and "__metadata__", an object of strings.
class HeaderReader final : public nlohmann::json_sax<nlohmann::json> {
 public:
  HeaderReader(const std::string& label, uint64_t data_bytes,
               std::vector<SafetensorsTensor>* tensors)
      : label_(label), data_bytes_(data_bytes), tensors_(tensors) {}

  const absl::Status& status() const { return status_; }

  bool null() override { return Scalar(); }
  bool boolean(bool) override { return Scalar(); }
  bool number_integer(number_integer_t) override { return Number(false, 0); }
  bool number_unsigned(number_unsigned_t v) override { return Number(true, v); }
  bool number_float(number_float_t, const string_t&) override { return Number(false, 0); }
  bool binary(binary_t&) override { return Scalar(); }
  bool string(string_t& v) override {
    if (at_ == At::kTensor && field_ == Field::kDtype) {
      tensor_.dtype = v;
      return true;
    }
    if (at_ == At::kMetadata) return true;
    return Scalar();
  }
  bool key(string_t& k) override {
    if (at_ == At::kTop) {
      if (k.empty() || k.size() > 1024) {
        return Fail(absl::StrCat("tensor '", k.substr(0, 64), "' has an empty or over-long name"));
      }
      if (tensors_->size() >= kMaxTensors) {
        return Fail(absl::StrCat("it names more than ", kMaxTensors, " tensors"));
      }
      name_ = k;
    } else if (at_ == At::kTensor) {
      field_ = k == "dtype"          ? Field::kDtype
               : k == "shape"        ? Field::kShape
               : k == "data_offsets" ? Field::kOffsets
                                     : Field::kOther;
      if (field_ != Field::kOther) {
        if (Seen(field_)) return FailTensor(absl::StrCat("names '", k, "' twice"));
        fields_seen_ |= 1u << static_cast<int>(field_);
      }
    }
    return true;  // keys of __metadata__ and of skipped values
  }
  bool start_object(std::size_t) override {
    switch (at_) {
      case At::kStart:
        at_ = At::kTop;
        return true;
      case At::kTop:
        if (name_ == "__metadata__") {
          at_ = At::kMetadata;
          return true;
        }
        at_ = At::kTensor;
        tensor_ = SafetensorsTensor();
        tensor_.name = name_;
        fields_seen_ = 0;
        offsets_.clear();
        field_ = Field::kOther;
        return true;
      case At::kTensor:
        if (field_ == Field::kOther) return Skip();
        return Wrong();
      case At::kSkip:
        return Skip();
      default:
        return Wrong();
    }
  }
  bool end_object() override {
    switch (at_) {
      case At::kTop:
        at_ = At::kDone;
        return true;
      case At::kMetadata:
        at_ = At::kTop;
        return true;
      case At::kTensor:
        at_ = At::kTop;
        return FinishTensor();
      case At::kSkip:
        return Unskip();
      default:
        return Wrong();
    }
  }
  bool start_array(std::size_t) override {
    if (at_ == At::kTensor && field_ == Field::kShape) {
      at_ = At::kShape;
      tensor_.shape.clear();
      numel_ = 1;
      return true;
    }
    if (at_ == At::kTensor && field_ == Field::kOffsets) {
      at_ = At::kOffsets;
      offsets_.clear();
      return true;
    }
    if (at_ == At::kSkip || (at_ == At::kTensor && field_ == Field::kOther)) return Skip();
    return Wrong();
  }
  bool end_array() override {
    if (at_ == At::kShape || at_ == At::kOffsets) {
      at_ = At::kTensor;
      return true;
    }
    if (at_ == At::kSkip) return Unskip();
    return Wrong();
  }
  bool parse_error(std::size_t position, const std::string&,
                   const nlohmann::detail::exception&) override {
    if (status_.ok()) {
      status_ = Bad(label_, absl::StrCat("its header is not JSON (it breaks off at byte ", position,
                                         " of the header)"));
    }
    return false;
  }

 private:
  // Where the reader is: before the header's object, in it, in "__metadata__", in a tensor's
  // object or its shape or data_offsets, inside a value of a key it ignores, or after the end.
  enum class At { kStart, kTop, kMetadata, kTensor, kShape, kOffsets, kSkip, kDone };
  enum class Field { kDtype, kShape, kOffsets, kOther };
  // No real checkpoint comes near these; they bound what a header can make the daemon hold.
  static constexpr size_t kMaxTensors = size_t{1} << 20;
  static constexpr int kMaxSkipDepth = 16;

  bool Fail(const std::string& what) {
    status_ = Bad(label_, what);
    return false;
  }
  bool FailTensor(const std::string& what) {
    return Fail(absl::StrCat("tensor '", tensor_.name, "' ", what));
  }
  // A value where the shape above allows none of its kind.
  bool Wrong() {
    switch (at_) {
      case At::kStart:
        return Fail("its header is not a JSON object");
      case At::kTop:
        if (name_ == "__metadata__") return Fail("its __metadata__ is not an object of strings");
        return Fail(absl::StrCat("tensor '", name_, "' is not a JSON object"));
      case At::kMetadata:
        return Fail("its __metadata__ has a value that is not a string");
      case At::kTensor:
        return field_ == Field::kDtype   ? FailTensor("has no dtype string")
               : field_ == Field::kShape ? FailTensor("has no shape array")
                                         : FailTensor("has no data_offsets [begin, end]");
      case At::kShape:
        return FailTensor("has a shape entry that is not a whole number >= 0");
      case At::kOffsets:
        return FailTensor("has data_offsets that are not whole numbers >= 0");
      default:
        return Fail("it has more than one JSON value in its header");
    }
  }
  // A string, number, boolean or null outside a shape, data_offsets or dtype.
  bool Scalar() {
    if (at_ == At::kSkip || (at_ == At::kTensor && field_ == Field::kOther)) return true;
    return Wrong();
  }
  bool Number(bool whole, uint64_t v) {
    if (at_ == At::kShape) {
      if (!whole) return Wrong();
      if (tensor_.shape.size() == 16) return FailTensor("has more than 16 dimensions");
      tensor_.shape.push_back(v);
      numel_ *= v;
      if (numel_ > std::numeric_limits<uint64_t>::max() / 8)
        return FailTensor("has an absurd shape");
      return true;
    }
    if (at_ == At::kOffsets) {
      if (!whole) return Wrong();
      if (offsets_.size() == 2) return FailTensor("has no data_offsets [begin, end]");
      offsets_.push_back(v);
      return true;
    }
    return Scalar();
  }
  bool Seen(Field f) const { return (fields_seen_ >> static_cast<int>(f)) & 1u; }
  bool Skip() {
    if (at_ != At::kSkip) {
      at_ = At::kSkip;
      skip_depth_ = 0;
    }
    if (++skip_depth_ > kMaxSkipDepth) {
      return FailTensor(absl::StrCat("has a value nested deeper than ", kMaxSkipDepth, " levels"));
    }
    return true;
  }
  bool Unskip() {
    if (--skip_depth_ == 0) at_ = At::kTensor;
    return true;
  }
  bool FinishTensor() {
    SafetensorsTensor& t = tensor_;
    // A field's key seen means its value was read: a value of the wrong kind failed the parse.
    if (!Seen(Field::kDtype)) return FailTensor("has no dtype string");
    if (!Seen(Field::kShape)) return FailTensor("has no shape array");
    if (offsets_.size() != 2) return FailTensor("has no data_offsets [begin, end]");
    const uint64_t elem = SafetensorsDtypeBytes(t.dtype);
    if (elem == 0) return FailTensor(absl::StrCat("has an unknown dtype '", t.dtype, "'"));
    t.begin = offsets_[0];
    t.end = offsets_[1];
    if (t.end < t.begin) return FailTensor("has data_offsets whose end is before its begin");
    if (t.end > data_bytes_) {
      return FailTensor(absl::StrCat("ends at byte ", t.end, " of the data, which has only ",
                                     data_bytes_,
                                     " bytes (the file is truncated or the header lies)"));
    }
    const uint64_t want = static_cast<uint64_t>(numel_) * elem;
    if (t.bytes() != want) {
      return FailTensor(absl::StrCat("spans ", t.bytes(), " bytes but its shape and dtype ",
                                     t.dtype, " need ", want));
    }
    tensors_->push_back(std::move(t));
    return true;
  }

  const std::string& label_;
  const uint64_t data_bytes_;
  std::vector<SafetensorsTensor>* tensors_;
  absl::Status status_;
  At at_ = At::kStart;
  Field field_ = Field::kOther;
  std::string name_;  // the top-level key being read
  SafetensorsTensor tensor_;
  unsigned fields_seen_ = 0;  // bits of Field: dtype, shape and data_offsets may come once each
  std::vector<uint64_t> offsets_;
  unsigned __int128 numel_ = 1;
  int skip_depth_ = 0;
};

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

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(std::string json, const std::string& label,
                                                         uint64_t file_bytes) {
  SafetensorsHeader h;
  h.label = label;
  h.file_bytes = file_bytes;
  h.data_offset = 8 + json.size();
  if (h.data_offset > file_bytes) {
    return Bad(label, absl::StrCat("its header says ", json.size(), " bytes but the file has ",
                                   file_bytes, " bytes"));
  }
  HeaderReader reader(label, file_bytes - h.data_offset, &h.tensors);
  const bool parsed = nlohmann::json::sax_parse(json, &reader);
  if (!reader.status().ok()) return reader.status();
  if (!parsed) return Bad(label, "its header is not JSON");  // sax_parse failed without a reason
  h.header_json = std::move(json);
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
  std::vector<std::string_view> names;
  names.reserve(h.tensors.size());
  for (const SafetensorsTensor& t : h.tensors) names.push_back(t.name);
  std::sort(names.begin(), names.end());
  const auto twice = std::adjacent_find(names.begin(), names.end());
  if (twice != names.end()) {
    return Bad(label, absl::StrCat("tensor '", absl::string_view(twice->data(), twice->size()),
                                   "' is named twice in its header"));
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
  return ParseSafetensorsHeader(std::move(json), label, file_bytes);
}

}  // namespace tsd::stores
