// DeviceCopies holds the device (VRAM) copies of weight stores: with `gpu_stores = true`, a job
// that uses a store may ask for it on a GPU (named by UUID), and every job asking for the same
// store on the same GPU maps one copy, which tsd owns (it outlives any one trainer). A copy is
// CUDA VMM memory that tsd fills from the sealed host store and hands out as a POSIX file
// descriptor (daemon/cuda/device_allocation.h) over the uid-checked side socket; no client ever
// writes it through tsd.
//
// The CUDA driver is loaded when the first job asks (never at start), so a tsd without a GPU or
// driver runs as before and refuses only these requests, saying why. Copies follow their store's
// lifetime: users are jobs (a job's death or release removes it, its process's mapping dies with
// it), an unused copy is kept for the store's `keep` and then dropped, a dropped or evicted store
// drops its copies, and when a GPU is full the least recently used unused copies on it are
// dropped to make room. Device memory is charged to no ledger (it is not host memory); `tsctl
// stores` shows it.
//
// Thread safety: every method may be called from any thread. One mutex guards the books; the
// allocation and the copy to the GPU run outside it. Lock order: the StoreManager's, then this.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/cuda/device_allocation.h"
#include "daemon/cuda/driver_api.h"
#include "proto/mutex.h"

namespace tsd::stores {

// A store's copy on one GPU, as `tsctl stores` shows it.
struct DeviceCopyStatus {
  std::string gpu_uuid;
  uint64_t bytes = 0;  // device memory held
  uint32_t users = 0;
  double idle_s = 0;
};

// A device copy as a job gets it: a descriptor (owned by the caller) of `size` bytes of device
// memory, of which the first `data_bytes` are the store's bytes.
struct OpenedDeviceCopy {
  int fd = -1;
  std::string gpu_uuid;
  uint64_t size = 0;
  uint64_t data_bytes = 0;
};

class DeviceCopies final {
 public:
  using DriverLoader = std::function<absl::StatusOr<std::shared_ptr<const cuda::DriverApi>>()>;
  // `enabled` is the `gpu_stores` setting; `loader` loads the driver (tests give another).
  explicit DeviceCopies(bool enabled, DriverLoader loader = &cuda::DriverApi::Shared);
  ~DeviceCopies();
  DeviceCopies(const DeviceCopies&) = delete;
  DeviceCopies& operator=(const DeviceCopies&) = delete;

  bool enabled() const { return enabled_; }
  // The copy of store `store` (whose sealed bytes are `data`, `bytes` long, valid for the call)
  // on GPU `gpu_uuid`, made now if there is none; `user` counts among its users.
  absl::StatusOr<OpenedDeviceCopy> Open(uint64_t store, const std::string& user, const void* data,
                                        uint64_t bytes, const std::string& gpu_uuid)
      ABSL_LOCKS_EXCLUDED(mu_);
  // `user` stops using store `store`'s copies (it closed the store, or was released).
  void Leave(uint64_t store, const std::string& user) ABSL_LOCKS_EXCLUDED(mu_);
  // `user` uses no copy from now on.
  void UserReleased(const std::string& user) ABSL_LOCKS_EXCLUDED(mu_);
  // Store `store` is gone: its copies are dropped (the memory goes once importers unmapped it).
  void DropStore(uint64_t store, const char* reason) ABSL_LOCKS_EXCLUDED(mu_);
  // Drops unused copies idle for `keep` or longer.
  void Sweep(absl::Time now, absl::Duration keep) ABSL_LOCKS_EXCLUDED(mu_);
  // Store `store`'s complete copies.
  std::vector<DeviceCopyStatus> Of(uint64_t store) const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t TotalBytes() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Copy {
    uint64_t store = 0;
    std::string gpu_uuid;
    int ordinal = 0;
    std::shared_ptr<cuda::DeviceAllocation> memory;
    bool ready = false;
    absl::Status failure;
    std::set<std::string> users;
    absl::Time last_used;
    uint64_t data_bytes = 0;
  };
  using CopyPtr = std::shared_ptr<Copy>;
  using Key = std::pair<uint64_t, std::string>;

  absl::StatusOr<std::shared_ptr<const cuda::DriverApi>> Driver() ABSL_LOCKS_EXCLUDED(mu_);
  // Allocates and fills `copy` (outside the lock), evicting unused copies on its GPU when full.
  absl::Status Make(const CopyPtr& copy, std::shared_ptr<const cuda::DriverApi> api,
                    const void* data) ABSL_LOCKS_EXCLUDED(mu_);
  bool EvictOneOnGpuLocked(int ordinal, std::vector<CopyPtr>& dead)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropLocked(const Key& key, const char* reason, std::vector<CopyPtr>& dead)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const bool enabled_;
  const DriverLoader loader_;
  mutable Mutex mu_;
  CondVar made_;
  bool driver_tried_ ABSL_GUARDED_BY(mu_) = false;
  absl::StatusOr<std::shared_ptr<const cuda::DriverApi>> driver_ ABSL_GUARDED_BY(mu_);
  std::map<Key, CopyPtr> copies_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tsd::stores
