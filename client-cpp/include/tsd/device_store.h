// tsd/device_store.h: a weight store's device copy, mapped into this process on one GPU
// (docs/stores.md, "Device copies"). With `gpu_stores = true` in tsd, a job that uses a store asks
// for it on a GPU (Client::OpenDeviceStore, naming the GPU by UUID); tsd makes one copy per GPU
// and sends a descriptor of it (CUDA VMM memory as a POSIX file descriptor) over the side socket,
// and this process maps it (read-only where the driver allows). Several jobs on one GPU then hold
// one copy of the base in VRAM. The CUDA driver is loaded at run time: without it, opening fails
// with FAILED_PRECONDITION and nothing else changes.
//
//   auto store = client->OpenStore(files, spec);
//   auto dev = client->OpenDeviceStore((*store)->id(), *tsd::GpuUuid(0));
//   // NF4 codes of a tensor t on the GPU at (*dev)->address() + t.offset
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace tsd {

// The UUID of GPU `ordinal` of this process ("GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as
// nvidia-smi -L shows it); FAILED_PRECONDITION without a CUDA driver.
absl::StatusOr<std::string> GpuUuid(int ordinal);
// The ordinal in this process (what torch calls cuda:N) of the GPU with `uuid`.
absl::StatusOr<int> GpuOrdinal(const std::string& uuid);

// A device copy mapped here. Destroying it unmaps it (tsd keeps the copy for its other users, and
// for `store_keep` after the last one leaves).
class DeviceStoreView final {
 public:
  ~DeviceStoreView();
  DeviceStoreView(const DeviceStoreView&) = delete;
  DeviceStoreView& operator=(const DeviceStoreView&) = delete;

  uint64_t store_id() const { return store_id_; }
  const std::string& gpu_uuid() const { return gpu_uuid_; }
  int device() const { return device_; }               // the GPU's ordinal in this process
  uint64_t address() const { return address_; }        // a device pointer
  uint64_t size() const { return size_; }              // mapped bytes
  uint64_t data_bytes() const { return data_bytes_; }  // of them, the store's (its layout)
  bool read_only() const { return read_only_; }
  // Why the mapping is read-write, when the driver refused read-only.
  const std::string& access_note() const { return access_note_; }

  // Maps `size` bytes behind `fd` (not taken) on the GPU `gpu_uuid` (Client::OpenDeviceStore).
  static absl::StatusOr<std::shared_ptr<DeviceStoreView>> Map(uint64_t store_id,
                                                              const std::string& gpu_uuid, int fd,
                                                              uint64_t size, uint64_t data_bytes);

 private:
  DeviceStoreView() = default;
  std::shared_ptr<void> mapping_;  // a tsd::cuda::DeviceMapping
  uint64_t store_id_ = 0;
  std::string gpu_uuid_;
  int device_ = -1;
  uint64_t address_ = 0, size_ = 0, data_bytes_ = 0;
  bool read_only_ = false;
  std::string access_note_;
};

}  // namespace tsd
