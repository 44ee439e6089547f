#include "daemon/stores/store_builder.h"

// xxHash compiled in (header only), so the daemon needs no libxxhash at run time.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/cpu/quant.h"
#include "proto/status_macros.h"
#include "proto/wire.h"

namespace tsd::stores {
namespace {

constexpr uint64_t kAlign = 64;
constexpr uint64_t kChunk = 8ull << 20;  // bytes read at a time

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

absl::Status PreadAll(const SourceFile& f, void* out, uint64_t n, uint64_t offset,
                      const std::string& tensor) {
  auto* p = static_cast<char*>(out);
  while (n > 0) {
    const ssize_t got = pread(f.fd, p, n, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          f.label, ": reading tensor '", tensor,
          "' failed: ", got < 0 ? std::strerror(errno) : "the file ended early (did it change?)"));
    }
    p += got;
    n -= static_cast<uint64_t>(got);
    offset += static_cast<uint64_t>(got);
  }
  return absl::OkStatus();
}

absl::StatusOr<kernels::DType> QuantInputDtype(const std::string& dtype) {
  if (dtype == "F32") return kernels::DType::kF32;
  if (dtype == "BF16") return kernels::DType::kBF16;
  if (dtype == "F16") return kernels::DType::kF16;
  return absl::InvalidArgumentError("not a float dtype");
}

}  // namespace

const char* StoreFormatName(StoreFormat f) {
  switch (f) {
    case StoreFormat::kNone:
      return "none";
    case StoreFormat::kNf4:
      return "nf4";
    case StoreFormat::kInt8:
      return "int8";
  }
  return "unknown";
}

absl::StatusOr<StoreFormat> ParseStoreFormat(const std::string& name) {
  if (name == "none" || name.empty()) return StoreFormat::kNone;
  if (name == "nf4") return StoreFormat::kNf4;
  if (name == "int8") return StoreFormat::kInt8;
  return absl::InvalidArgumentError(
      absl::StrCat("store format '", name, "' is not one of none, nf4, int8"));
}

absl::StatusOr<StorePlan> PlanStore(const std::vector<SourceFile>& files, const StoreSpec& spec) {
  if (files.empty()) {
    return absl::InvalidArgumentError(
        "a store needs the descriptors of its checkpoint files; none came (send each file with "
        "a store_file request first)");
  }
  StorePlan plan;
  plan.format = spec.format;
  plan.block_size = spec.block_size;
  // Every tensor of every file, by name.
  std::map<std::string, std::pair<uint32_t, const SafetensorsTensor*>> all;
  plan.headers.reserve(files.size());
  for (uint32_t i = 0; i < files.size(); ++i) {
    TSD_ASSIGN_OR_RETURN(SafetensorsHeader h,
                         ReadSafetensorsHeader(files[i].fd, files[i].label,
                                               static_cast<uint64_t>(files[i].st.st_size)));
    plan.headers.push_back(std::move(h));
  }
  for (uint32_t i = 0; i < plan.headers.size(); ++i) {
    for (const SafetensorsTensor& t : plan.headers[i].tensors) {
      auto [it, fresh] = all.emplace(t.name, std::make_pair(i, &t));
      if (!fresh) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor '", t.name, "' is in both ", plan.headers[it->second.first].label, " and ",
            plan.headers[i].label, "; a store's files must not repeat a tensor"));
      }
    }
  }
  // What the store holds: the request's tensors, or every one.
  std::map<std::string, bool> wanted;  // name -> quantize
  if (spec.tensors.empty()) {
    for (const auto& [name, where] : all) wanted[name] = false;
  }
  for (const StoreSpec::Tensor& t : spec.tensors) {
    auto it = all.find(t.name);
    if (it == all.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", t.name, "' is in none of the ", files.size(),
                       " checkpoint file(s) (the first is ", plan.headers[0].label,
                       "); ask only for tensors "
                       "the files hold"));
    }
    if (!wanted.emplace(t.name, t.quantize).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", t.name, "' is named twice in the store request"));
    }
    if (!t.quantize) continue;
    const SafetensorsTensor& src = *it->second.second;
    const std::string& file = plan.headers[it->second.first].label;
    if (spec.format == StoreFormat::kNone) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", t.name, "' (", file,
                       ") is marked to quantize, but the store's format is "
                       "'none'; ask for nf4 or int8, or do not mark it"));
    }
    if (!QuantInputDtype(src.dtype).ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", t.name, "' of ", file, " is ", src.dtype,
                       "; only F32, BF16 and F16 tensors can be quantized"));
    }
    const kernels::QuantKind kind =
        spec.format == StoreFormat::kNf4 ? kernels::QuantKind::kNf4 : kernels::QuantKind::kInt8;
    if (absl::Status s =
            kernels::ValidateQuantShape(kind, static_cast<int64_t>(src.numel()), spec.block_size);
        !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", t.name, "' of ", file, ": ", s.message()));
    }
  }
  // The layout: file by file, in the order of the data.
  uint64_t at = 0;
  for (uint32_t i = 0; i < plan.headers.size(); ++i) {
    for (const SafetensorsTensor& t : plan.headers[i].tensors) {
      auto w = wanted.find(t.name);
      if (w == wanted.end()) continue;
      StoredTensor s;
      s.name = t.name;
      s.dtype = t.dtype;
      s.shape = t.shape;
      s.file = i;
      s.source_begin = t.begin;
      s.source_end = t.end;
      s.quantized = w->second;
      s.offset = at = AlignUp(at, kAlign);
      if (s.quantized) {
        const kernels::QuantKind kind =
            spec.format == StoreFormat::kNf4 ? kernels::QuantKind::kNf4 : kernels::QuantKind::kInt8;
        const auto n = static_cast<int64_t>(t.numel());
        s.bytes = static_cast<uint64_t>(kernels::QuantCodeBytes(kind, n));
        s.absmax_count = static_cast<uint64_t>(kernels::QuantNumBlocks(n, spec.block_size));
        s.absmax_offset = AlignUp(s.offset + s.bytes, kAlign);
        at = s.absmax_offset + s.absmax_count * sizeof(float);
      } else {
        s.bytes = t.bytes();
        at = s.offset + s.bytes;
      }
      plan.tensors.push_back(std::move(s));
    }
  }
  plan.bytes = AlignUp(std::max<uint64_t>(at, 1), wire::kPageBytes);
  return plan;
}

absl::StatusOr<std::string> FillStore(const StorePlan& plan, const std::vector<SourceFile>& files,
                                      uint8_t* out, kernels::Isa isa) {
  XXH3_state_t* state = XXH3_createState();
  if (state == nullptr) return absl::ResourceExhaustedError("out of memory for the digest");
  struct Free {
    XXH3_state_t* s;
    ~Free() { XXH3_freeState(s); }
  } free_state{state};
  XXH3_64bits_reset(state);
  std::map<std::pair<uint32_t, std::string>, const StoredTensor*> stored;
  for (const StoredTensor& t : plan.tensors) stored[{t.file, t.name}] = &t;
  std::vector<uint8_t> scratch;
  for (uint32_t i = 0; i < plan.headers.size(); ++i) {
    const SafetensorsHeader& h = plan.headers[i];
    const SourceFile& f = files[i];
    XXH3_64bits_update(state, h.header_json.data(), h.header_json.size());
    for (const SafetensorsTensor& t : h.tensors) {
      auto it = stored.find({i, t.name});
      const StoredTensor* s = it == stored.end() ? nullptr : it->second;
      const uint64_t from = h.data_offset + t.begin;
      if (s != nullptr && !s->quantized) {
        // Straight into the store, then hashed from there.
        TSD_RETURN_IF_ERROR(PreadAll(f, out + s->offset, t.bytes(), from, t.name));
        XXH3_64bits_update(state, out + s->offset, t.bytes());
        continue;
      }
      if (s == nullptr) {  // not in the store: read only to hash it
        scratch.resize(std::min<uint64_t>(std::max<uint64_t>(t.bytes(), 1), kChunk));
        for (uint64_t done = 0; done < t.bytes();) {
          const uint64_t n = std::min<uint64_t>(kChunk, t.bytes() - done);
          TSD_RETURN_IF_ERROR(PreadAll(f, scratch.data(), n, from + done, t.name));
          XXH3_64bits_update(state, scratch.data(), n);
          done += n;
        }
        continue;
      }
      scratch.resize(std::max<uint64_t>(t.bytes(), 1));
      TSD_RETURN_IF_ERROR(PreadAll(f, scratch.data(), t.bytes(), from, t.name));
      XXH3_64bits_update(state, scratch.data(), t.bytes());
      kernels::QuantizedView view;
      view.kind =
          plan.format == StoreFormat::kNf4 ? kernels::QuantKind::kNf4 : kernels::QuantKind::kInt8;
      view.block_size = plan.block_size;
      view.n = static_cast<int64_t>(t.numel());
      view.codes = out + s->offset;
      view.absmax = reinterpret_cast<float*>(out + s->absmax_offset);
      if (absl::Status q = kernels::Quantize(scratch.data(), *QuantInputDtype(t.dtype), view, isa);
          !q.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat(f.label, ": tensor '", t.name, "' cannot be quantized: ", q.message()));
      }
    }
  }
  return absl::StrFormat("xxh3-64:%016x", XXH3_64bits_digest(state));
}

}  // namespace tsd::stores
