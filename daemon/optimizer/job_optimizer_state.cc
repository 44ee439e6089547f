// JobOptimizer's state file: the optimizer state as a safetensors file, so a checkpoint can be
// read by any safetensors reader. Per bucket b: "b<b>.master" (F32), "b<b>.exp_avg" and
// "b<b>.exp_avg_sq" (F32 or BF16, as registered) and "b<b>.step" (I64, one element); the metadata
// names the format and the layout, and loading checks all of it before changing anything.
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <nlohmann/json.hpp>

// xxHash compiled in (header only): the state's checksums.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "daemon/optimizer/job_optimizer.h"
#include "proto/state_format.h"
#include "proto/status_macros.h"

namespace tsd {
namespace {

constexpr uint64_t kMaxHeaderBytes = 64ull << 20;
// The metadata key of the entries' checksums: "<name>:<16 hex digits of xxh3-64>,..." in file
// order. Written by SaveState; verified by LoadState when present (state files written by other
// tools, such as the Python client's load_state_dict(), carry none).
constexpr char kChecksumKey[] = "xxh3_64";
// The metadata key of a partial file (SaveState with a bucket list): how many buckets it holds.
// LoadState refuses such a file.
constexpr char kPartialKey[] = "partial";

std::string Hex64(uint64_t v) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i, v >>= 4) out[static_cast<size_t>(i)] = kDigits[v & 0xf];
  return out;
}

const char* SafetensorsDType(kernels::DType d) {
  switch (d) {
    case kernels::DType::kF32:
      return "F32";
    case kernels::DType::kBF16:
      return "BF16";
    case kernels::DType::kF16:
      return "F16";
  }
  return "?";
}

// HeaderBound reads a state file's header once as a stream before it is parsed into a document,
// and stops at the first value deeper than a state header goes (the header's object, a tensor's
// object, its shape or offsets: 3 levels) or past a count of values and keys proportional to the
// job's buckets. A document costs the daemon many times the header's bytes (a 40 MB header of
// nested arrays took 1.5 GB), which a client could otherwise ask for with every load_state; with
// the bound it costs about what a real state header of the job's layout would.
class HeaderBound final : public nlohmann::json_sax<nlohmann::json> {
 public:
  explicit HeaderBound(uint64_t max_items) : max_items_(max_items) {}
  // Empty when the header is within the bound (or is not JSON: the document parse says so).
  const std::string& why() const { return why_; }

  bool null() override { return Item(); }
  bool boolean(bool) override { return Item(); }
  bool number_integer(number_integer_t) override { return Item(); }
  bool number_unsigned(number_unsigned_t) override { return Item(); }
  bool number_float(number_float_t, const string_t&) override { return Item(); }
  bool string(string_t&) override { return Item(); }
  bool binary(binary_t&) override { return Item(); }
  bool key(string_t&) override { return Item(); }
  bool start_object(std::size_t) override { return Open(); }
  bool start_array(std::size_t) override { return Open(); }
  bool end_object() override { return Close(); }
  bool end_array() override { return Close(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    return false;
  }

 private:
  static constexpr int kMaxDepth = 3;

  bool Item() {
    if (++items_ <= max_items_) return true;
    why_ = absl::StrCat("the state file's header has more than ", max_items_,
                        " values and keys, more than a state of this optimizer's layout has");
    return false;
  }
  bool Open() {
    if (++depth_ > kMaxDepth) {
      why_ = absl::StrCat("the state file's header nests deeper than the ", kMaxDepth,
                          " levels of a state header");
      return false;
    }
    return Item();
  }
  bool Close() {
    --depth_;
    return true;
  }

  const uint64_t max_items_;
  uint64_t items_ = 0;
  int depth_ = 0;
  std::string why_;
};

// At most this much of a refused tensor's header entry is quoted back in the error.
constexpr size_t kMaxQuotedBytes = 256;

struct Entry {
  std::string name;
  const char* dtype;
  int64_t numel;
  char* data;  // where the bytes live in the daemon
  uint64_t bytes;
};

absl::Status CheckFile(int fd) {
  struct stat st {};
  if (fd < 0 || fstat(fd, &st) != 0)
    return absl::InvalidArgumentError("no valid descriptor came with the request");
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        "the state descriptor must be a regular file or a memfd (not a pipe or socket)");
  }
  return absl::OkStatus();
}

absl::Status WriteAll(int fd, const char* p, uint64_t n, uint64_t offset) {
  while (n > 0) {
    const ssize_t w = pwrite(fd, p, std::min<uint64_t>(n, 1ull << 30), static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      return absl::ResourceExhaustedError(
          absl::StrCat("writing the state file failed: ", std::strerror(errno)));
    }
    p += w;
    n -= static_cast<uint64_t>(w);
    offset += static_cast<uint64_t>(w);
  }
  return absl::OkStatus();
}

absl::Status ReadAll(int fd, char* p, uint64_t n, uint64_t offset) {
  while (n > 0) {
    const ssize_t r = pread(fd, p, std::min<uint64_t>(n, 1ull << 30), static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return absl::InvalidArgumentError("the state file is shorter than its header says");
    p += r;
    n -= static_cast<uint64_t>(r);
    offset += static_cast<uint64_t>(r);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<uint64_t> JobOptimizer::SaveState(int fd, absl::Span<const uint32_t> buckets) {
  TSD_RETURN_IF_ERROR(CheckFile(fd));
  TSD_RETURN_IF_ERROR(CheckBucketList("save_state", buckets));
  MutexLock lock(state_mu_);
  if (!Idle()) {
    return absl::FailedPreconditionError(
        "the optimizer has deliveries in flight; save between steps (wait for every bucket first)");
  }
  // A whole save leaves retired buckets out (their state lives in the trainer's GPU share) and
  // says so: the file is then partial.
  std::vector<size_t> chosen;
  for (const uint32_t b : buckets) {
    if (runs_[b]->retired) {
      return absl::FailedPreconditionError(
          absl::StrCat("save_state: bucket ", b,
                       " was retired (its optimizer moved to the trainer's GPU share); tsd has no "
                       "state for it"));
    }
    chosen.push_back(b);
  }
  if (buckets.empty()) {
    for (size_t b = 0; b < runs_.size(); ++b) {
      if (!runs_[b]->retired) chosen.push_back(b);
    }
  }
  const size_t msize = kernels::DTypeSize(plan_.moment_dtype);
  std::vector<Entry> entries;
  std::vector<int64_t> steps(runs_.size());
  for (const size_t b : chosen) {
    BucketRun& r = *runs_[b];
    const int64_t n = r.plan.numel;
    steps[b] = r.steps;
    entries.push_back({wire::StateEntryName(b, wire::StatePart::kMaster), "F32", n,
                       reinterpret_cast<char*>(r.master), static_cast<uint64_t>(n) * 4});
    entries.push_back({wire::StateEntryName(b, wire::StatePart::kExpAvg),
                       SafetensorsDType(plan_.moment_dtype), n, static_cast<char*>(r.exp_avg),
                       n * msize});
    entries.push_back({wire::StateEntryName(b, wire::StatePart::kExpAvgSq),
                       SafetensorsDType(plan_.moment_dtype), n, static_cast<char*>(r.exp_avg_sq),
                       n * msize});
    entries.push_back({wire::StateEntryName(b, wire::StatePart::kStep), "I64", 1,
                       reinterpret_cast<char*>(&steps[b]), 8});
  }
  std::string checksums;
  for (const auto& e : entries) {
    absl::StrAppend(&checksums, checksums.empty() ? "" : ",", e.name, ":",
                    Hex64(XXH3_64bits(e.data, e.bytes)));
  }
  nlohmann::json header;
  header["__metadata__"] = {{"format", wire::kStateFormat},
                            {"buckets", std::to_string(runs_.size())},
                            {"moment_dtype", SafetensorsDType(plan_.moment_dtype)},
                            {"committed", std::to_string(committed_local_)},
                            {kChecksumKey, checksums}};
  if (chosen.size() != runs_.size())
    header["__metadata__"][kPartialKey] = std::to_string(chosen.size());
  uint64_t offset = 0;
  for (const auto& e : entries) {
    header[e.name] = {
        {"dtype", e.dtype}, {"shape", {e.numel}}, {"data_offsets", {offset, offset + e.bytes}}};
    offset += e.bytes;
  }
  std::string h = header.dump();
  while ((8 + h.size()) % 8 != 0) h.push_back(' ');
  const uint64_t hlen = h.size();
  char len_bytes[8];
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<char>((hlen >> (8 * i)) & 0xff);
  if (ftruncate(fd, 0) != 0)
    return absl::InvalidArgumentError(
        absl::StrCat("cannot truncate the state file: ", std::strerror(errno)));
  TSD_RETURN_IF_ERROR(WriteAll(fd, len_bytes, 8, 0));
  TSD_RETURN_IF_ERROR(WriteAll(fd, h.data(), hlen, 8));
  uint64_t pos = 8 + hlen;
  for (const auto& e : entries) {
    TSD_RETURN_IF_ERROR(WriteAll(fd, e.data, e.bytes, pos));
    pos += e.bytes;
  }
  return pos;
}

absl::StatusOr<uint64_t> JobOptimizer::LoadState(int fd) {
  TSD_RETURN_IF_ERROR(CheckFile(fd));
  MutexLock lock(state_mu_);
  if (!Idle())
    return absl::FailedPreconditionError(
        "the optimizer has deliveries in flight; load between steps");
  struct stat st {};
  fstat(fd, &st);
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  unsigned char len_bytes[8];
  if (file_bytes < 8 || !ReadAll(fd, reinterpret_cast<char*>(len_bytes), 8, 0).ok()) {
    return absl::InvalidArgumentError("the state file is too short to be safetensors");
  }
  uint64_t hlen = 0;
  for (int i = 0; i < 8; ++i) hlen |= static_cast<uint64_t>(len_bytes[i]) << (8 * i);
  if (hlen > kMaxHeaderBytes || 8 + hlen > file_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("the state file's header length ", hlen, " is not plausible"));
  }
  std::string h(hlen, '\0');
  TSD_RETURN_IF_ERROR(ReadAll(fd, h.data(), hlen, 8));
  // A real header: per bucket 4 entries of about 12 values, keys and containers, and the metadata.
  HeaderBound bound(64 * (4 * runs_.size() + 8));
  if (!nlohmann::json::sax_parse(h, &bound) && !bound.why().empty()) {
    return absl::InvalidArgumentError(bound.why());
  }
  const nlohmann::json header = nlohmann::json::parse(h, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object())
    return absl::InvalidArgumentError("the state file's header is not JSON");
  const auto meta = header.find("__metadata__");
  if (meta == header.end() || !meta->is_object() || !meta->contains("format") ||
      !(*meta)["format"].is_string() ||
      (*meta)["format"].get<std::string>() != wire::kStateFormat) {
    return absl::InvalidArgumentError(
        absl::StrCat("the file is not a tsd optimizer state (", wire::kStateFormat, ")"));
  }
  if (meta->contains(kPartialKey)) {
    return absl::InvalidArgumentError(
        "the state file holds only some of the buckets (a partial save_state); save the whole "
        "state "
        "to load it");
  }
  const size_t msize = kernels::DTypeSize(plan_.moment_dtype);
  const uint64_t data_start = 8 + hlen, data_bytes = file_bytes - data_start;
  struct Source {
    uint64_t begin;
    uint64_t bytes;
    char* dest;
    std::string name;
  };
  std::vector<Source> sources;
  std::vector<int64_t> steps(runs_.size());
  size_t expected_entries = 1;  // __metadata__
  for (size_t b = 0; b < runs_.size(); ++b) {
    BucketRun& r = *runs_[b];
    const int64_t n = r.plan.numel;
    const Entry want[] = {
        {wire::StateEntryName(b, wire::StatePart::kMaster), "F32", n,
         reinterpret_cast<char*>(r.master), static_cast<uint64_t>(n) * 4},
        {wire::StateEntryName(b, wire::StatePart::kExpAvg), SafetensorsDType(plan_.moment_dtype), n,
         static_cast<char*>(r.exp_avg), n * msize},
        {wire::StateEntryName(b, wire::StatePart::kExpAvgSq), SafetensorsDType(plan_.moment_dtype),
         n, static_cast<char*>(r.exp_avg_sq), n * msize},
        {wire::StateEntryName(b, wire::StatePart::kStep), "I64", 1,
         reinterpret_cast<char*>(&steps[b]), 8}};
    for (const Entry& e : want) {
      ++expected_entries;
      const auto it = header.find(e.name);
      if (it == header.end() || !it->is_object()) {
        return absl::InvalidArgumentError(
            absl::StrCat("the state file has no tensor '", e.name,
                         "': it was saved for another optimizer layout"));
      }
      const auto& t = *it;
      // Every field's type is checked before it is read: json's value()/get() throw otherwise.
      if (!t.contains("dtype") || !t["dtype"].is_string() ||
          t["dtype"].get<std::string>() != e.dtype || !t.contains("shape") ||
          t["shape"] != nlohmann::json::array({e.numel}) || !t.contains("data_offsets") ||
          !t["data_offsets"].is_array() || t["data_offsets"].size() != 2 ||
          !t["data_offsets"][0].is_number_unsigned() ||
          !t["data_offsets"][1].is_number_unsigned()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor '", e.name, "' in the state file is ", t.dump().substr(0, kMaxQuotedBytes),
            "; expected dtype ", e.dtype, " and shape [", e.numel, "]"));
      }
      const uint64_t begin = t["data_offsets"][0], end = t["data_offsets"][1];
      if (end < begin || end - begin != e.bytes || end > data_bytes) {
        return absl::InvalidArgumentError(absl::StrCat("tensor '", e.name, "' has data offsets [",
                                                       begin, ", ", end, ") that do not fit ",
                                                       e.bytes, " bytes in the file"));
      }
      // A retired bucket's entries are checked like any (the file is a whole state of this
      // layout) but not loaded: its state lives in the trainer's GPU share, and its moments'
      // pages are gone.
      if (!r.retired) sources.push_back({data_start + begin, e.bytes, e.data, e.name});
    }
  }
  if (header.size() != expected_entries) {
    return absl::InvalidArgumentError(absl::StrCat("the state file holds ", header.size() - 1,
                                                   " tensors; this optimizer has ",
                                                   expected_entries - 1));
  }
  // Read everything into a staging copy first, so a short read changes nothing.
  uint64_t total = 0;
  for (const auto& s : sources) total += s.bytes;
  std::vector<char> staging(total);
  uint64_t at = 0;
  for (const auto& s : sources) {
    TSD_RETURN_IF_ERROR(ReadAll(fd, staging.data() + at, s.bytes, s.begin));
    at += s.bytes;
  }
  if (meta->contains(kChecksumKey)) {
    // Every tensor's checksum, before anything is changed.
    if (!(*meta)[kChecksumKey].is_string()) {
      return absl::InvalidArgumentError("the state file's checksums are not a string");
    }
    std::map<std::string, std::string, std::less<>> want;
    for (absl::string_view item : absl::StrSplit((*meta)[kChecksumKey].get<std::string>(), ',')) {
      const size_t colon = item.rfind(':');
      if (colon == absl::string_view::npos) {
        return absl::InvalidArgumentError("the state file's checksums are malformed");
      }
      want[std::string(item.substr(0, colon))] = std::string(item.substr(colon + 1));
    }
    at = 0;
    for (const auto& s : sources) {
      const std::string got = Hex64(XXH3_64bits(staging.data() + at, s.bytes));
      const auto it = want.find(s.name);
      if (it == want.end() || it->second != got) {
        return absl::DataLossError(absl::StrCat(
            "the state file is corrupt: tensor '", s.name, "' has checksum xxh3-64 ", got,
            it == want.end() ? ", and the file records none for it"
                             : absl::StrCat(" but the file records ", it->second),
            "; nothing was loaded (use an intact copy of the checkpoint)"));
      }
      at += s.bytes;
    }
  }
  at = 0;
  for (const auto& s : sources) {
    std::memcpy(s.dest, staging.data() + at, s.bytes);
    at += s.bytes;
  }
  for (size_t b = 0; b < runs_.size(); ++b) {
    if (runs_[b]->retired) continue;
    runs_[b]->steps = steps[b];
    page_.buckets[b].steps.store(static_cast<uint32_t>(steps[b]), std::memory_order_relaxed);
  }
  return file_bytes;
}

}  // namespace tsd
