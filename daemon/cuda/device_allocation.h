// DeviceAllocation is device memory of one GPU that tsd owns and shares: CUDA VMM memory
// (cuMemCreate) made exportable as a POSIX file descriptor, so a trainer that receives the
// descriptor over the side socket (SCM_RIGHTS) maps the very same memory. tsd fills it once from a
// sealed host store (Fill) and never maps it afterwards; the memory lives until tsd drops the
// allocation and every process that imported it has unmapped it (or died).
//
// Thread safety: Fill and Export may be called from any thread, not concurrently with
// destruction.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/cuda/driver_api.h"
#include "daemon/cuda/primary_context.h"

namespace tsd::cuda {

class DeviceAllocation final {
 public:
  // Allocates `bytes` (rounded up to the GPU's granularity) on GPU `ordinal`. FAILED_PRECONDITION
  // when the GPU cannot export VMM memory as a descriptor, RESOURCE_EXHAUSTED when it is full.
  static absl::StatusOr<std::unique_ptr<DeviceAllocation>> Create(
      std::shared_ptr<const DriverApi> api, int ordinal, uint64_t bytes);
  ~DeviceAllocation();  // cuMemRelease (the memory goes once importers unmapped it too)
  DeviceAllocation(const DeviceAllocation&) = delete;
  DeviceAllocation& operator=(const DeviceAllocation&) = delete;

  // Copies `bytes` (at most size()) from `src` to the start of the memory and zeroes the rest;
  // returns once the copy is complete.
  absl::Status Fill(const void* src, uint64_t bytes);
  // A new descriptor of the memory (the caller owns it).
  absl::StatusOr<int> Export() const;

  uint64_t size() const { return size_; }
  int ordinal() const { return context_->ordinal(); }

 private:
  DeviceAllocation(std::shared_ptr<PrimaryContext> context, DriverApi::Handle handle, uint64_t size)
      : context_(std::move(context)), handle_(handle), size_(size) {}
  std::shared_ptr<PrimaryContext> context_;
  DriverApi::Handle handle_;
  uint64_t size_;
};

// The allocation properties of exportable device memory on GPU `ordinal`.
abi::CUmemAllocationProp ExportableDeviceMemory(int ordinal);
// `bytes` rounded up to the allocation granularity of such memory on GPU `ordinal`.
absl::StatusOr<uint64_t> RoundToGranularity(const DriverApi& api, int ordinal, uint64_t bytes);

}  // namespace tsd::cuda
