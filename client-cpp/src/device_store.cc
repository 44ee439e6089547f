#include "tsd/device_store.h"

#include "absl/strings/str_cat.h"
#include "daemon/cuda/device_mapping.h"
#include "daemon/cuda/driver_api.h"
#include "proto/status_macros.h"

namespace tsd {

absl::StatusOr<std::string> GpuUuid(int ordinal) {
  TSD_ASSIGN_OR_RETURN(auto api, cuda::DriverApi::Shared());
  return api->UuidOf(ordinal);
}

absl::StatusOr<int> GpuOrdinal(const std::string& uuid) {
  TSD_ASSIGN_OR_RETURN(auto api, cuda::DriverApi::Shared());
  return api->FindDevice(uuid);
}

DeviceStoreView::~DeviceStoreView() = default;

absl::StatusOr<std::shared_ptr<DeviceStoreView>> DeviceStoreView::Map(uint64_t store_id,
                                                                      const std::string& gpu_uuid,
                                                                      int fd, uint64_t size,
                                                                      uint64_t data_bytes) {
  if (data_bytes > size || size == 0) {
    return absl::InternalError(absl::StrCat("tsd sent a device copy of ", size, " bytes holding ",
                                            data_bytes, ": not mappable"));
  }
  TSD_ASSIGN_OR_RETURN(auto api, cuda::DriverApi::Shared());
  TSD_ASSIGN_OR_RETURN(const int ordinal, api->FindDevice(gpu_uuid));
  TSD_ASSIGN_OR_RETURN(std::unique_ptr<cuda::DeviceMapping> m,
                       cuda::DeviceMapping::Import(api, fd, size, ordinal));
  std::shared_ptr<DeviceStoreView> view(new DeviceStoreView());
  view->store_id_ = store_id;
  view->gpu_uuid_ = gpu_uuid;
  view->device_ = ordinal;
  view->address_ = m->address();
  view->size_ = size;
  view->data_bytes_ = data_bytes;
  view->read_only_ = m->read_only();
  view->access_note_ = m->access_note();
  view->mapping_ = std::shared_ptr<cuda::DeviceMapping>(std::move(m));
  return view;
}

}  // namespace tsd
