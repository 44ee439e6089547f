// DeviceMapping is a trainer's view of device memory another process (tsd) exported as a POSIX
// file descriptor: imported (cuMemImportFromShareableHandle), mapped at an address of this
// process (cuMemAddressReserve, cuMemMap) and made accessible to the GPU, read-only where the
// driver allows it, else read-write (read_only() says which). The mapping holds the memory; the
// descriptor may be closed once Import returns. Destroying it unmaps; a process that dies loses
// its mapping with its CUDA context.
//
// Thread safety: immutable after Import.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/cuda/driver_api.h"
#include "daemon/cuda/primary_context.h"

namespace tsd::cuda {

class DeviceMapping final {
 public:
  // Maps the first `size` bytes of the memory behind `fd` (not taken) on GPU `ordinal`.
  static absl::StatusOr<std::unique_ptr<DeviceMapping>> Import(std::shared_ptr<const DriverApi> api,
                                                               int fd, uint64_t size, int ordinal);
  ~DeviceMapping();
  DeviceMapping(const DeviceMapping&) = delete;
  DeviceMapping& operator=(const DeviceMapping&) = delete;

  DriverApi::CUdeviceptr address() const { return ptr_; }
  uint64_t size() const { return size_; }
  int ordinal() const { return context_->ordinal(); }
  bool read_only() const { return read_only_; }
  // Why the mapping is read-write when read_only() is false (the driver's refusal).
  const std::string& access_note() const { return access_note_; }

 private:
  DeviceMapping(std::shared_ptr<PrimaryContext> context, DriverApi::CUdeviceptr ptr, uint64_t size)
      : context_(std::move(context)), ptr_(ptr), size_(size) {}
  std::shared_ptr<PrimaryContext> context_;
  DriverApi::CUdeviceptr ptr_;
  uint64_t size_;
  bool mapped_ = false;
  bool read_only_ = false;
  std::string access_note_;
};

}  // namespace tsd::cuda
