#include "daemon/cuda/device_mapping.h"

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "proto/status_macros.h"

namespace tsd::cuda {

absl::StatusOr<std::unique_ptr<DeviceMapping>> DeviceMapping::Import(
    std::shared_ptr<const DriverApi> api, int fd, uint64_t size, int ordinal) {
  if (fd < 0 || size == 0) {
    return absl::InvalidArgumentError("importing device memory needs a descriptor and a size");
  }
  TSD_ASSIGN_OR_RETURN(auto context, PrimaryContext::Retain(api, ordinal));
  TSD_ASSIGN_OR_RETURN(auto scope, context->Enter());
  DriverApi::Handle handle = 0;
  TSD_RETURN_IF_ERROR(api->Check(
      api->cuMemImportFromShareableHandle(
          &handle, reinterpret_cast<void*>(static_cast<intptr_t>(fd)), abi::kHandleTypePosixFd),
      "cuMemImportFromShareableHandle"));
  DriverApi::CUdeviceptr ptr = 0;
  absl::Status status =
      api->Check(api->cuMemAddressReserve(&ptr, size, 0, 0, 0), "cuMemAddressReserve");
  if (!status.ok()) {
    api->cuMemRelease(handle);
    return status;
  }
  std::unique_ptr<DeviceMapping> m(new DeviceMapping(std::move(context), ptr, size));
  status = api->Check(api->cuMemMap(ptr, size, 0, handle, 0),
                      absl::StrCat("cuMemMap of ", size, " bytes").c_str());
  api->cuMemRelease(handle);  // the mapping keeps the memory
  TSD_RETURN_IF_ERROR(status);
  m->mapped_ = true;
  abi::CUmemAccessDesc access{};
  access.location.type = abi::kLocationTypeDevice;
  access.location.id = ordinal;
  access.flags = abi::kAccessProtRead;
  absl::Status ro = api->Check(api->cuMemSetAccess(ptr, size, &access, 1), "cuMemSetAccess(READ)");
  if (ro.ok()) {
    m->read_only_ = true;
    return m;
  }
  access.flags = abi::kAccessProtReadWrite;
  TSD_RETURN_IF_ERROR(
      api->Check(api->cuMemSetAccess(ptr, size, &access, 1), "cuMemSetAccess(READWRITE)"));
  m->access_note_ = absl::StrCat("the driver refused a read-only mapping (", ro.message(),
                                 "), so it is mapped read-write: do not write to it");
  return m;
}

DeviceMapping::~DeviceMapping() {
  const DriverApi& api = context_->api();
  auto scope = context_->Enter();
  if (mapped_) api.cuMemUnmap(ptr_, size_);
  api.cuMemAddressFree(ptr_, size_);
}

}  // namespace tsd::cuda
