// The store builder turns checkpoint files a client handed over (as descriptors) into the
// contents of a store, in two steps. PlanStore reads and checks the files' safetensors headers
// and the client's request (each named tensor exists in exactly one file, is named once, and can
// be quantized when asked: a float dtype and a valid block size) and lays the store out: every
// tensor 64-byte aligned, as stored or as codes plus fp32 absmax per block (kernels/cpu/quant.h).
// FillStore then reads every tensor of the files once (so the content digest, xxh3-64 over each
// header and each tensor's bytes in file order, covers the whole checkpoint), copies or
// quantizes the ones the store holds into its memory, and returns the digest. Neither keeps any
// state; the StoreManager decides when to build and what to do with the result.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/stores/safetensors.h"
#include "kernels/cpu/adamw.h"

namespace tsd::stores {

// The formats of a store: "none" (as stored), "nf4", "int8".
enum class StoreFormat { kNone, kNf4, kInt8 };
const char* StoreFormatName(StoreFormat f);
// Parses a format name; INVALID_ARGUMENT naming the accepted ones otherwise.
absl::StatusOr<StoreFormat> ParseStoreFormat(const std::string& name);

// What a client asks for: the store's format and block size, and which tensors it holds and
// which of them are quantized. An empty `tensors` means every tensor of the files, as stored.
struct StoreSpec {
  struct Tensor {
    std::string name;
    bool quantize = false;
  };
  StoreFormat format = StoreFormat::kNone;
  uint32_t block_size = 64;
  std::vector<Tensor> tensors;
};

// One source file: a descriptor the client opened (owned by the caller), what fstat said of it,
// and how errors name it.
struct SourceFile {
  int fd = -1;
  struct stat st {};
  std::string label;
};

// One tensor of a store.
struct StoredTensor {
  std::string name;
  std::string dtype;  // as the checkpoint stores it ("BF16", ...)
  std::vector<uint64_t> shape;
  uint32_t file = 0;          // index of its source file
  uint64_t source_begin = 0;  // its span in that file's data section
  uint64_t source_end = 0;
  bool quantized = false;      // codes in the store's format, else the bytes as stored
  uint64_t offset = 0;         // of the data (as stored) or of the codes, in the store
  uint64_t bytes = 0;          // of the data or of the codes
  uint64_t absmax_offset = 0;  // quantized only: fp32 absmax, one per block
  uint64_t absmax_count = 0;
};

struct StorePlan {
  StoreFormat format = StoreFormat::kNone;
  uint32_t block_size = 0;
  std::vector<SafetensorsHeader> headers;  // one per source file
  std::vector<StoredTensor> tensors;       // in the store's order (file, then offset)
  uint64_t bytes = 0;                      // the store's size, page-rounded
};

// Reads the headers of `files` and lays out the store `spec` asks for.
absl::StatusOr<StorePlan> PlanStore(const std::vector<SourceFile>& files, const StoreSpec& spec);

// Reads the files, fills `out` (plan.bytes writable bytes) and returns the content digest
// ("xxh3-64:" and 16 hex digits). An error (a file shorter than its header says, a non-finite
// value in a tensor to quantize, ...) names the file and tensor; `out` is then garbage.
absl::StatusOr<std::string> FillStore(const StorePlan& plan, const std::vector<SourceFile>& files,
                                      uint8_t* out, kernels::Isa isa);

}  // namespace tsd::stores
