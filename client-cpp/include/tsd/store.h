// Weight stores on the client side: a store is a set of read-only tensors (a base model's frozen
// weights in one format) that tsd builds from checkpoint files this process opened and shares
// with every job that presents the same files (docs/stores.md). `Client::OpenStore` sends the
// files' descriptors, and tsd finds the store or builds it (reading, and quantizing the tensors
// asked for); the result is a StoreView: the store mapped read-only into this process and its
// tensor table. Nothing can write through the mapping (a write faults); the bytes are shared with
// every other process that maps the store.
//
//   tsd::StoreSpec spec{.format = "nf4", .block_size = 64,
//                       .tensors = {{"model.layers.0.mlp.up_proj.weight", true}}};
//   auto store = (*client)->OpenStore({"/models/base/model.safetensors"}, spec);
//   const tsd::StoreTensorView* up = (*store)->Find("model.layers.0.mlp.up_proj.weight");
//   const uint8_t* codes = (*store)->data() + up->offset;
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tsd {

// What a store holds: its format and block size, and which tensors (each named once; empty:
// every tensor of the files, as stored). Only F32/BF16/F16 tensors can be quantized.
struct StoreSpec {
  struct Tensor {
    std::string name;
    bool quantize = false;  // store it in `format` (nf4 or int8); else as stored
  };
  std::string format = "none";  // none, nf4 or int8
  uint32_t block_size = 64;     // elements per absmax block (nf4: even)
  std::vector<Tensor> tensors;
};

// One tensor of a store: where its bytes lie in the mapping.
struct StoreTensorView {
  std::string name;
  std::string dtype;  // as the checkpoint stored it: "BF16", "F32", "I64", ...
  std::vector<uint64_t> shape;
  bool quantized = false;  // codes in the store's format, then fp32 absmax per block
  uint64_t offset = 0;     // of the data, or of the codes (64-byte aligned)
  uint64_t bytes = 0;      // of the data, or of the codes
  uint64_t absmax_offset = 0;
  uint64_t absmax_count = 0;
};

// A store's copy on one GPU (tsd's gpu_stores; tsd/device_store.h).
struct DeviceCopyStatus {
  std::string gpu_uuid;
  uint64_t bytes = 0;  // device memory held
  uint32_t users = 0;
  double idle_s = 0;
};

// A store as `Client::ListStores` (and `tsctl stores`) reports it.
struct StoreStatus {
  uint64_t id = 0;
  std::string source;  // the files' paths when tsd built it
  std::string format;
  uint32_t block_size = 0;
  uint64_t bytes = 0;
  uint32_t users = 0;  // jobs using it
  double idle_s = 0;   // since its last user left
  std::string digest;  // of the checkpoint's content
  uint32_t tensors = 0;
  bool locked = false;
  std::vector<DeviceCopyStatus> device_copies = {};
};

// What `Client::ListStores` (and `tsctl stores`) reports. A store is described only to the uids
// that proved they may read its files (a job of theirs opened it; tsd remembers the last 32 such
// uids per store) and to tsd's own uid; the totals cover every store of the node.
struct StoreListing {
  std::vector<StoreStatus> stores;  // the caller's, by id
  uint64_t node_stores = 0;         // complete stores on the node, the caller's and others'
  uint64_t node_bytes = 0;          // their bytes
  uint64_t budget_bytes = 0;        // the store budget (tsd's store_budget)
  uint32_t omitted = 0;             // stores of the caller's left out of an oversized reply
  // Stores on the node this listing does not describe (held by other uids, or omitted).
  uint64_t not_shown() const {
    return node_stores > stores.size() ? node_stores - stores.size() : 0;
  }
};

// A store mapped read-only into this process. Destroying it unmaps it; the job keeps using the
// store in tsd until `Client::CloseStore` or until the job is released.
class StoreView final {
 public:
  ~StoreView();
  StoreView(const StoreView&) = delete;
  StoreView& operator=(const StoreView&) = delete;

  const StoreStatus& status() const { return status_; }
  uint64_t id() const { return status_.id; }
  uint64_t size() const { return status_.bytes; }
  // The read-only mapping.
  const uint8_t* data() const { return data_; }
  // The store's read-only descriptor in this process.
  int fd() const { return fd_; }
  const std::vector<StoreTensorView>& tensors() const { return tensors_; }
  // The tensor called `name`, or null.
  const StoreTensorView* Find(const std::string& name) const;
  // True when this open built the store (false: it existed, and no tensor data was read).
  bool built() const { return built_; }

 private:
  friend class Client;
  StoreView() = default;

  StoreStatus status_;
  std::vector<StoreTensorView> tensors_;
  int fd_ = -1;
  const uint8_t* data_ = nullptr;
  bool built_ = false;
};

}  // namespace tsd
