#include "daemon/cuda/device_allocation.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "proto/status_macros.h"

namespace tsd::cuda {

abi::CUmemAllocationProp ExportableDeviceMemory(int ordinal) {
  abi::CUmemAllocationProp prop{};
  prop.type = abi::kAllocationTypePinned;
  prop.requestedHandleTypes = abi::kHandleTypePosixFd;
  prop.location.type = abi::kLocationTypeDevice;
  prop.location.id = ordinal;
  return prop;
}

absl::StatusOr<uint64_t> RoundToGranularity(const DriverApi& api, int ordinal, uint64_t bytes) {
  const abi::CUmemAllocationProp prop = ExportableDeviceMemory(ordinal);
  size_t granularity = 0;
  TSD_RETURN_IF_ERROR(api.Check(
      api.cuMemGetAllocationGranularity(&granularity, &prop, abi::kGranularityRecommended),
      "cuMemGetAllocationGranularity"));
  if (granularity == 0) granularity = 2u << 20;
  const uint64_t g = granularity;
  return std::max<uint64_t>(1, (bytes + g - 1) / g) * g;
}

absl::StatusOr<std::unique_ptr<DeviceAllocation>> DeviceAllocation::Create(
    std::shared_ptr<const DriverApi> api, int ordinal, uint64_t bytes) {
  int vmm = 0, fd_ok = 0;
  TSD_RETURN_IF_ERROR(api->Check(
      api->cuDeviceGetAttribute(&vmm, abi::kAttrVirtualMemoryManagementSupported, ordinal),
      "cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)"));
  TSD_RETURN_IF_ERROR(
      api->Check(api->cuDeviceGetAttribute(&fd_ok, abi::kAttrHandleTypePosixFdSupported, ordinal),
                 "cuDeviceGetAttribute(HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)"));
  if (vmm == 0 || fd_ok == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("GPU ", ordinal, " cannot share memory as a file descriptor (CUDA VMM: ",
                     vmm ? "yes" : "no", ", POSIX descriptor handles: ", fd_ok ? "yes" : "no",
                     "); device copies of stores need both"));
  }
  TSD_ASSIGN_OR_RETURN(auto context, PrimaryContext::Retain(api, ordinal));
  TSD_ASSIGN_OR_RETURN(auto scope, context->Enter());
  TSD_ASSIGN_OR_RETURN(const uint64_t size, RoundToGranularity(*api, ordinal, bytes));
  const abi::CUmemAllocationProp prop = ExportableDeviceMemory(ordinal);
  DriverApi::Handle handle = 0;
  TSD_RETURN_IF_ERROR(api->Check(api->cuMemCreate(&handle, size, &prop, 0),
                                 absl::StrCat("cuMemCreate of ", size, " bytes").c_str()));
  return std::unique_ptr<DeviceAllocation>(new DeviceAllocation(std::move(context), handle, size));
}

DeviceAllocation::~DeviceAllocation() {
  auto scope = context_->Enter();
  context_->api().cuMemRelease(handle_);
}

absl::Status DeviceAllocation::Fill(const void* src, uint64_t bytes) {
  if (bytes > size_) {
    return absl::InvalidArgumentError(
        absl::StrCat("filling ", bytes, " bytes into a device allocation of ", size_));
  }
  const DriverApi& api = context_->api();
  TSD_ASSIGN_OR_RETURN(auto scope, context_->Enter());
  DriverApi::CUdeviceptr ptr = 0;
  TSD_RETURN_IF_ERROR(
      api.Check(api.cuMemAddressReserve(&ptr, size_, 0, 0, 0), "cuMemAddressReserve"));
  absl::Status status = api.Check(api.cuMemMap(ptr, size_, 0, handle_, 0), "cuMemMap");
  if (status.ok()) {
    abi::CUmemAccessDesc access{};
    access.location.type = abi::kLocationTypeDevice;
    access.location.id = ordinal();
    access.flags = abi::kAccessProtReadWrite;
    status = api.Check(api.cuMemSetAccess(ptr, size_, &access, 1), "cuMemSetAccess");
    // `src` may be a read-only mapping (a sealed store's): a host-to-device copy only reads it.
    if (status.ok()) status = api.Check(api.cuMemcpyHtoD(ptr, src, bytes), "cuMemcpyHtoD");
    if (status.ok() && bytes < size_) {
      status = api.Check(api.cuMemsetD8(ptr + bytes, 0, size_ - bytes), "cuMemsetD8");
    }
    // The copy from pageable memory may still be in flight when cuMemcpyHtoD returns.
    if (status.ok()) status = api.Check(api.cuCtxSynchronize(), "cuCtxSynchronize");
    api.cuMemUnmap(ptr, size_);
  }
  api.cuMemAddressFree(ptr, size_);
  return status;
}

absl::StatusOr<int> DeviceAllocation::Export() const {
  const DriverApi& api = context_->api();
  TSD_ASSIGN_OR_RETURN(auto scope, context_->Enter());
  int fd = -1;
  TSD_RETURN_IF_ERROR(
      api.Check(api.cuMemExportToShareableHandle(&fd, handle_, abi::kHandleTypePosixFd, 0),
                "cuMemExportToShareableHandle"));
  return fd;
}

}  // namespace tsd::cuda
